"""The DeepSeek-V4 sparse contract on REFERENCE (`mla_sparse_decode_v4`, `mla_sparse_prefill_v4`): every
format, the attention sink, both KV segments, empty and all -1 rows, duplicate indices, topk_length 0, the
window empty, against a float64 oracle written here (a loop over tokens on the dequantised rows); the
errors that name their argument; selection (REFERENCE serves, the other backends say why not); the
torch.library ops under fullgraph compile."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import cache_formats as cf
from mla_multi import registry
from mla_multi.dims import MLADims
from mla_multi.platforms import override

HEADS = 4
SCALE = 512 ** -0.5


def oracle(q, segments, scale, sink=None):
    """float64 sparse attention: q [T, N, 512]; segments [(rows [S, 512], indices [T, k], lengths [T] | None)].
    Every valid entry (0 <= index < S, inside the token's length) is a key and its value (duplicates twice);
    one softmax over all segments; out *= 1 / (1 + exp(sink - lse)); nothing to attend: 0 and -inf."""
    tokens, heads, width = q.shape
    out = torch.zeros(tokens, heads, width, dtype=torch.float64)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float64)
    for t in range(tokens):
        keys = []
        for rows, indices, lengths in segments:
            count = indices.shape[1] if lengths is None else int(lengths[t])
            for j in range(count):
                i = int(indices[t, j])
                if 0 <= i < rows.shape[0]:
                    keys.append(rows[i].double())
        if not keys:
            continue
        keys = torch.stack(keys)
        for h in range(heads):
            scores = [float(q[t, h].double() @ k) * scale for k in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            row_lse = top + math.log(total)
            value = sum(w * k for w, k in zip(weights, keys)) / total
            if sink is not None:
                value = value / (1 + math.exp(float(sink[h]) - row_lse))
            out[t, h], lse[t, h] = value, row_lse
    return out, lse


def _cache(fmt_name: str, blocks: int, block_size: int, gen, dtype=torch.float64):
    """(cache, its dequantised rows [slots, 512] float64) with every slot written by concat_and_cache_mla_v4."""
    rows = torch.randn(blocks * block_size, 512, generator=gen, dtype=torch.float64)
    if fmt_name == "rows":
        cache = rows.to(dtype).reshape(blocks, block_size, 512)
        return cache, cache.reshape(-1, 512).double()
    fmt = cf.get_format(fmt_name)
    cache = fmt.allocate(blocks, block_size)
    mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], cache, torch.arange(blocks * block_size))
    return cache, fmt.dequantize(fmt.quantize(rows), torch.float64)


def _indices(gen, tokens, topk, slots, *, minus_ones=True):
    idx = torch.randint(0, slots, (tokens, topk), generator=gen, dtype=torch.int32)
    if minus_ones:
        idx[torch.rand(tokens, topk, generator=gen) < 0.2] = -1
    idx[0, 1] = idx[0, 0]  # a duplicate counts twice
    return idx


PAIRS = [("fp8_ds_mla_v4", None), ("fp8_ds_mla_v4", "fp8_ds_mla_v4"), ("fp8_ds_mla_v41", None),
         ("fp8_ds_mla_v41", "fp8_ds_mla_v41"), ("fp8_ds_mla_v41", "fp4_ds_mla_v41"), ("rows", "rows")]


@pytest.mark.parametrize("main,extra", PAIRS, ids=lambda v: str(v))
def test_decode_matches_the_float64_oracle(main, extra):
    gen = torch.Generator().manual_seed(1)
    tokens = 5
    cache, rows = _cache(main, 3, 8, gen)
    q = torch.randn(tokens, HEADS, 512, generator=gen, dtype=torch.float64)
    indices = _indices(gen, tokens, 16, 24)
    lengths = torch.tensor([16, 3, 0, 9, 16], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, math.inf, -2.0], dtype=torch.float32)
    kwargs = dict(topk_length=lengths, attn_sink=sink)
    segments = [(rows, indices, lengths)]
    if extra is not None:
        extra_cache, extra_rows = _cache(extra, 2, 5, gen)  # its own block size
        extra_indices = _indices(gen, tokens, 6, 10)
        extra_lengths = torch.tensor([6, 0, 0, 2, 6], dtype=torch.int32)  # token 1: the window empty
        kwargs.update(extra_kv_cache=extra_cache, extra_indices=extra_indices, extra_topk_length=extra_lengths)
        segments.append((extra_rows, extra_indices, extra_lengths))
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, return_lse=True, **kwargs)
    want_out, want_lse = oracle(q, segments, SCALE, sink)
    assert out.dtype == torch.float64 and out.shape == (tokens, HEADS, 512) and lse.shape == (tokens, HEADS)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)
    assert torch.equal(out[:, 2], torch.zeros(tokens, 512, dtype=torch.float64))  # sink +inf: zeros
    if extra is None:  # token 2 has topk_length 0 and no window: nothing to attend
        assert bool((lse[2] == -math.inf).all()) and not bool(out[2].any())


def test_decode_into_a_given_buffer_copies_where_the_backend_writes_its_own():
    """`ops.sparse_decode_v4_into` (the V4 layer's way in): REFERENCE declares no `v4_takes_out`, so its result is
    copied into the caller's buffer, which the call returns; a buffer of the wrong shape or strides is refused."""
    gen = torch.Generator().manual_seed(4)
    cache, rows = _cache("fp8_ds_mla_v4", 3, 8, gen)
    q = torch.randn(3, HEADS, 512, generator=gen, dtype=torch.float64)
    indices = _indices(gen, 3, 16, 24)
    sink = torch.tensor([0.5, -math.inf, 1.0, -2.0], dtype=torch.float32)
    out = torch.full((3, HEADS, 512), math.nan, dtype=torch.float64)
    assert not mm.backends.reference.ReferenceSparseDecodeImpl.v4_takes_out
    result = mm.ops.sparse_decode_v4_into(out, q, cache, indices, SCALE, attn_sink=sink)
    assert result is out
    torch.testing.assert_close(out, oracle(q, [(rows, indices, None)], SCALE, sink)[0], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="out"):
        mm.ops.sparse_decode_v4_into(torch.empty(3, HEADS, 511, dtype=torch.float64), q, cache, indices, SCALE)
    with pytest.raises(ValueError, match="out has strides"):
        mm.ops.sparse_decode_v4_into(torch.empty(3, HEADS, 1024, dtype=torch.float64)[..., :512], q, cache,
                                     indices, SCALE)


def test_reference_decode_of_many_entries_runs_in_parts(monkeypatch):
    """REFERENCE dequantises every named row of a call at once: past `base.V4_ROWS_AT_ONCE` entries it runs the
    tokens in parts (here two of 16 + 6 entries a part), each token's lengths and window its own."""
    from mla_multi.backends import base, reference

    gen = torch.Generator().manual_seed(7)
    cache, rows = _cache("fp8_ds_mla_v41", 3, 8, gen)
    extra_cache, extra_rows = _cache("fp4_ds_mla_v41", 2, 5, gen)
    q = torch.randn(5, HEADS, 512, generator=gen, dtype=torch.float64)
    indices, extra_indices = _indices(gen, 5, 16, 24), _indices(gen, 5, 6, 10)
    lengths = torch.tensor([16, 3, 0, 9, 16], dtype=torch.int32)
    extra_lengths = torch.tensor([6, 0, 0, 2, 6], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, 1.0, -2.0], dtype=torch.float32)
    parts = []
    whole = reference._forward_v4
    monkeypatch.setattr(reference, "_forward_v4", lambda q, *rest, **kw: parts.append(q.shape[0]) or whole(q, *rest, **kw))
    monkeypatch.setattr(base, "V4_ROWS_AT_ONCE", 44)
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, topk_length=lengths, attn_sink=sink,
                                           extra_kv_cache=extra_cache, extra_indices=extra_indices,
                                           extra_topk_length=extra_lengths, backend="REFERENCE", return_lse=True)
    assert parts == [2, 2, 1]
    want_out, want_lse = oracle(q, [(rows, indices, lengths), (extra_rows, extra_indices, extra_lengths)], SCALE, sink)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)
    assert lse.dtype == torch.float64


def test_decode_batch_and_query_length_layout():
    gen = torch.Generator().manual_seed(2)
    cache, rows = _cache("fp8_ds_mla_v4", 2, 64, gen)
    extra_cache, extra_rows = _cache("fp8_ds_mla_v4", 2, 64, gen)
    batch, q_len = 2, 3
    q = torch.randn(batch, q_len, HEADS, 512, generator=gen, dtype=torch.float64)
    indices = _indices(gen, batch * q_len, 8, 128).reshape(batch, q_len, 8)
    extra_indices = _indices(gen, batch * q_len, 4, 128).reshape(batch, q_len, 4)
    lengths = torch.tensor([5, 8], dtype=torch.int32)  # one a request, for each of its query tokens
    extra_lengths = torch.tensor([4, 1], dtype=torch.int32)
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, topk_length=lengths,
                                           extra_kv_cache=extra_cache, extra_indices=extra_indices,
                                           extra_topk_length=extra_lengths, return_lse=True)
    assert out.shape == (batch, q_len, HEADS, 512) and lse.shape == (batch, q_len, HEADS)
    want_out, want_lse = oracle(q.reshape(-1, HEADS, 512),
                                [(rows, indices.reshape(-1, 8), lengths.repeat_interleave(q_len)),
                                 (extra_rows, extra_indices.reshape(-1, 4), extra_lengths.repeat_interleave(q_len))],
                                SCALE)
    torch.testing.assert_close(out.reshape(-1, HEADS, 512), want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse.reshape(-1, HEADS), want_lse, rtol=1e-10, atol=1e-12)


def test_decode_empty_rows_and_sink_minus_inf():
    gen = torch.Generator().manual_seed(3)
    cache, rows = _cache("fp8_ds_mla_v41", 2, 4, gen)
    q = torch.randn(3, HEADS, 512, generator=gen, dtype=torch.float64)
    indices = torch.tensor([[-1, -1, -1], [2, 2, 2], [7, -1, 0]], dtype=torch.int32)  # all -1; duplicates only
    out, lse = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, return_lse=True)
    assert not bool(out[0].any()) and bool((lse[0] == -math.inf).all())
    torch.testing.assert_close(out[1], rows[2].expand(HEADS, 512), rtol=1e-12, atol=1e-12)  # one key thrice
    torch.testing.assert_close(lse[1], torch.logsumexp(torch.stack([q[1] @ rows[2] * SCALE] * 3), 0))
    sunk = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, attn_sink=torch.full((HEADS,), -math.inf))
    torch.testing.assert_close(sunk, out, rtol=0, atol=0)  # -inf changes nothing
    want, _ = oracle(q, [(rows, indices, None)], SCALE)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


def test_decode_bf16_query_over_each_format():
    gen = torch.Generator().manual_seed(4)
    for main, extra in PAIRS:
        cache, rows = _cache(main, 2, 16, gen, dtype=torch.bfloat16)
        q = torch.randn(4, HEADS, 512, generator=gen).to(torch.bfloat16)
        indices = _indices(gen, 4, 8, 32)
        kwargs, segments = {}, [(rows.to(torch.bfloat16).double() if main == "rows" else rows, indices, None)]
        if extra is not None:
            extra_cache, extra_rows = _cache(extra, 1, 16, gen, dtype=torch.bfloat16)
            extra_indices = _indices(gen, 4, 4, 16)
            kwargs = dict(extra_kv_cache=extra_cache, extra_indices=extra_indices)
            segments.append((extra_rows.to(torch.bfloat16).double() if extra == "rows" else extra_rows,
                             extra_indices, None))
        out = mm.ops.mla_sparse_decode_v4(q, cache, indices, SCALE, **kwargs)
        assert out.dtype == torch.bfloat16
        want, _ = oracle(q, segments, SCALE)
        torch.testing.assert_close(out.double(), want, rtol=2 ** -7, atol=1e-2)


def test_prefill_matches_the_float64_oracle():
    gen = torch.Generator().manual_seed(5)
    tokens, s_kv, s_extra = 6, 40, 12
    q = torch.randn(tokens, HEADS, 512, generator=gen, dtype=torch.float64)
    kv = torch.randn(s_kv, 512, generator=gen, dtype=torch.float64)
    extra_kv = torch.randn(s_extra, 512, generator=gen, dtype=torch.float64)
    indices = _indices(gen, tokens, 10, s_kv + 8)  # indices >= S_kv: no token in prefill
    extra_indices = _indices(gen, tokens, 4, s_extra)
    lengths = torch.tensor([10, 0, 4, 10, 7, 1], dtype=torch.int32)
    extra_lengths = torch.tensor([4, 0, 0, 2, 4, 4], dtype=torch.int32)
    sink = torch.tensor([1.0, 0.0, math.inf, -math.inf], dtype=torch.float32)
    out, lse = mm.ops.mla_sparse_prefill_v4(q, kv, indices, SCALE, topk_length=lengths, attn_sink=sink,
                                            extra_kv=extra_kv, extra_indices=extra_indices,
                                            extra_topk_length=extra_lengths, return_lse=True)
    want_out, want_lse = oracle(q, [(kv, indices, lengths), (extra_kv, extra_indices, extra_lengths)], SCALE, sink)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-12)
    assert not bool(out[1].any()) and bool((lse[1] == -math.inf).all())  # topk_length 0 and the window empty
    single = mm.ops.mla_sparse_prefill_v4(q, kv, indices, SCALE)
    torch.testing.assert_close(single, oracle(q, [(kv, indices, None)], SCALE)[0], rtol=1e-10, atol=1e-12)


def test_errors_name_the_argument():
    gen = torch.Generator().manual_seed(6)
    cache, _ = _cache("fp8_ds_mla_v4", 2, 4, gen)
    q = torch.randn(2, HEADS, 512, dtype=torch.float64)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    decode = mm.ops.mla_sparse_decode_v4
    with pytest.raises(ValueError, match="kv_cache has .*fp8_ds_mla_v41 format is uint8 \\[num_blocks, block_size, 528\\]"):
        decode(q, cache, idx, SCALE, kv_format="fp8_ds_mla_v41")
    with pytest.raises(ValueError, match="kv_cache of dtype torch.uint8 and shape \\(2, 4, 600\\) is in no cache format"):
        decode(q, torch.zeros(2, 4, 600, dtype=torch.uint8), idx, SCALE)
    with pytest.raises(ValueError, match="kv_cache is a fp8_ds_mla cache .*accepted here: fp8_ds_mla_v4"):
        decode(q, cf.FP8_DS_MLA.allocate(2, 4), idx, SCALE)
    with pytest.raises(ValueError, match="kv_cache is a fp4_ds_mla_v41 cache, which serves only as the second"):
        decode(q, cf.FP4_DS_MLA_V41.allocate(2, 4), idx, SCALE)
    with pytest.raises(ValueError, match="attn_sink"):
        decode(q, cache, idx, SCALE, attn_sink=torch.zeros(HEADS + 1))
    with pytest.raises(ValueError, match="attn_sink has dtype float64"):
        decode(q, cache, idx, SCALE, attn_sink=torch.zeros(HEADS, dtype=torch.float64))
    with pytest.raises(ValueError, match="extra_kv_cache is given without extra_indices"):
        decode(q, cache, idx, SCALE, extra_kv_cache=cache)
    with pytest.raises(ValueError, match="extra_indices is given without extra_kv_cache"):
        decode(q, cache, idx, SCALE, extra_indices=idx)
    with pytest.raises(ValueError, match="extra_kv_cache is a fp4_ds_mla_v41 cache beside a fp8_ds_mla_v4 kv_cache"):
        decode(q, cache, idx, SCALE, extra_kv_cache=cf.FP4_DS_MLA_V41.allocate(1, 4), extra_indices=idx)
    with pytest.raises(ValueError, match="extra_indices hold \\[9\\]"):
        decode(q, cache, idx, SCALE, extra_kv_cache=cache, extra_indices=torch.tensor([[0], [9]], dtype=torch.int32))
    with pytest.raises(ValueError, match="extra_topk_length=\\[2, 5\\]"):
        decode(q, cache, idx, SCALE, extra_kv_cache=cache, extra_indices=idx[:, :2],
               extra_topk_length=torch.tensor([2, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="q=.*the V4 contract takes q"):
        decode(torch.zeros(2, HEADS, 576), cache, idx, SCALE)
    with pytest.raises(ValueError, match="kv has .*accepted"):
        mm.ops.mla_sparse_prefill_v4(q, torch.zeros(8, 576, dtype=torch.float64), idx, SCALE)
    with pytest.raises(ValueError, match="extra_kv is given without extra_indices"):
        mm.ops.mla_sparse_prefill_v4(q, torch.zeros(8, 512, dtype=torch.float64), idx, SCALE,
                                     extra_kv=torch.zeros(8, 512, dtype=torch.float64))


def test_selection_serves_v4_on_reference_and_others_say_why_not():
    dims = MLADims(HEADS, kv_lora_rank=448, qk_rope_head_dim=64)
    for phase, fmt in (("sparse_decode", "fp8_ds_mla_v4"), ("sparse_prefill", "rows")):
        chosen = registry.select_sparse_backend(phase, dims, torch.bfloat16, torch.uint8, 512, kv_format=fmt,
                                                extra_kv_format=fmt, with_sink=True)
        assert chosen.name == "REFERENCE"
    with override("H100"):
        config = registry.sparse_config(dims, torch.bfloat16, torch.uint8, 512, kv_format="fp8_ds_mla_v4",
                                        extra_kv_format="fp8_ds_mla_v4", with_sink=True)
        rows = registry.default_registry.explain("sparse_decode", config)
        by_name = {row["name"]: row for row in rows} if "name" in rows[0] else {row["backend"]: row for row in rows}
        assert by_name["TRITON"]["reasons"] == []  # tests/test_sparse_v4_triton.py runs it
        # FLASHMLA runs this configuration where its wheel is installed (tests/test_backend_flashmla_v4.py)
        assert not any("V4 contract" in reason for reason in by_name["FLASHMLA"]["reasons"])
        assert "V4" in config.describe() and "fp8_ds_mla_v4" in config.describe()
    with override("MI355X"):
        config = registry.sparse_config(dims, torch.bfloat16, torch.uint8, 512, kv_format="fp8_ds_mla_v41",
                                        extra_kv_format="fp4_ds_mla_v41")
        for row in registry.default_registry.explain("sparse_decode", config):
            name = row.get("name", row.get("backend"))
            if name not in ("REFERENCE", "TRITON"):
                assert any("V4 contract" in reason for reason in row["reasons"]), row
    with pytest.raises(mm.NoBackendError):
        registry.select_sparse_backend("sparse_decode", dims, torch.bfloat16, torch.uint8, 512,
                                       kv_format="fp8_ds_mla_v4", backend="TRITON")
    with pytest.raises(ValueError, match="extra_kv_format='fp8_ds_mla_v4' without a kv_format"):
        registry.sparse_config(dims, torch.bfloat16, torch.uint8, 512, extra_kv_format="fp8_ds_mla_v4")
    from mla_multi.backends.reference import ReferenceSparseDecodeBackend

    assert "fp8_ds_mla_v4" in ReferenceSparseDecodeBackend.info()["v4_formats"]


def test_zero_tokens_and_empty_index_lists():
    cache = cf.FP8_DS_MLA_V4.allocate(2, 4)
    out = mm.ops.mla_sparse_decode_v4(torch.zeros(0, HEADS, 512), cache, torch.zeros(0, 3, dtype=torch.int32), SCALE)
    assert out.shape == (0, HEADS, 512)
    out, lse = mm.ops.mla_sparse_decode_v4(torch.ones(2, HEADS, 512), cache, torch.zeros(2, 0, dtype=torch.int32), SCALE,
                                           return_lse=True)
    assert not bool(out.any()) and bool((lse == -math.inf).all())


def test_v4_ops_compile_fullgraph_on_the_cpu():
    gen = torch.Generator().manual_seed(7)
    cache, _ = _cache("fp8_ds_mla_v4", 2, 8, gen)
    extra_cache, _ = _cache("fp8_ds_mla_v4", 1, 8, gen)
    q = torch.randn(3, HEADS, 512, generator=gen).to(torch.bfloat16)
    idx = _indices(gen, 3, 4, 16)
    extra_idx = _indices(gen, 3, 2, 8)
    sink = torch.zeros(HEADS)
    kv = torch.randn(16, 512, generator=gen).to(torch.bfloat16)
    kv_c, k_pe, slots = torch.randn(2, 448).to(torch.bfloat16), torch.randn(2, 64).to(torch.bfloat16), torch.tensor([3, 9])

    def fn(q, cache, extra_cache, kv):
        mm.ops.concat_and_cache_mla_v4(kv_c, k_pe, cache, slots)
        out, lse = mm.ops.mla_sparse_decode_v4(q, cache, idx, SCALE, attn_sink=sink, extra_kv_cache=extra_cache,
                                               extra_indices=extra_idx, return_lse=True)
        pre = mm.ops.mla_sparse_prefill_v4(q, kv, idx, SCALE, attn_sink=sink)
        return out, lse, pre

    eager_cache = cf.FP8_DS_MLA_V4.allocate(2, 8)
    eager_cache.copy_(cache)
    want = fn(q, eager_cache, extra_cache, kv)
    compiled_cache = cf.FP8_DS_MLA_V4.allocate(2, 8)
    compiled_cache.copy_(cache)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True)(q, compiled_cache, extra_cache, kv)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert torch.equal(cf.FP8_DS_MLA_V4.read_records(compiled_cache), cf.FP8_DS_MLA_V4.read_records(eager_cache))


def test_bad_indices_without_the_data_checks_give_nan_rows_and_the_flag():
    """What a GPU call without MLA_MULTI_CHECK_INPUTS gets (the CPU always checks, so the impl is called here)."""
    from mla_multi import errors
    from mla_multi.backends.reference import ReferenceSparseDecodeImpl

    gen = torch.Generator().manual_seed(8)
    cache, rows = _cache("fp8_ds_mla_v4", 2, 4, gen)
    q = torch.randn(3, HEADS, 512, generator=gen, dtype=torch.float64)
    indices = torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32)
    extra_indices = torch.tensor([[0], [-2], [8]], dtype=torch.int32)  # token 1: -2, token 2: past the cache
    errors.error_flag(q.device).zero_()
    impl = ReferenceSparseDecodeImpl(HEADS, 448, 64, q.device)
    out, lse = impl.forward_v4(q, cache, indices, SCALE, kv_format="fp8_ds_mla_v4", extra_kv=cache,
                               extra_indices=extra_indices, extra_kv_format="fp8_ds_mla_v4")
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())
    want, _ = oracle(q[:1], [(rows, indices[:1], None), (rows, extra_indices[:1], None)], SCALE)
    torch.testing.assert_close(out[:1], want, rtol=1e-10, atol=1e-12)
    assert int(errors.error_flag(q.device)) & errors.SPARSE_INDEX
    errors.error_flag(q.device).zero_()


def test_a_planned_call_checks_the_new_index_data():
    gen = torch.Generator().manual_seed(9)
    cache, _ = _cache("fp8_ds_mla_v4", 2, 4, gen)
    q = torch.randn(2, HEADS, 512, generator=gen)
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    mm.ops.mla_sparse_decode_v4(q, cache, good, SCALE, extra_kv_cache=cache, extra_indices=good)
    with pytest.raises(ValueError, match="extra_indices hold \\[8\\]"):
        mm.ops.mla_sparse_decode_v4(q, cache, good, SCALE, extra_kv_cache=cache,
                                    extra_indices=torch.tensor([[0, 1], [2, 8]], dtype=torch.int32))


def test_the_gpu_cross_check_calls_flashmla_as_published(pytestconfig):
    """tests/test_sparse_v4_gpu.py's FlashMLA call passes only keywords of the published sgl-flash-mla 1.0.0
    `flash_mla_with_kvcache`, whose documentation states the V4.1 layouts cache_formats follows."""
    import ast
    import pathlib
    import zipfile

    from published import adapter_keywords, published_distribution, published_parameters

    wheel = published_distribution(pytestconfig, "sgl-flash-mla==1.0.0", "sgl_flash_mla", ".whl",
                                   "MLA_MULTI_FLASHMLA_WHEEL", ("--only-binary", ":all:"))
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read("flash_mla/flash_mla_interface.py").decode("utf-8")
    function = next(node for node in ast.parse(source).body
                    if isinstance(node, ast.FunctionDef) and node.name == "flash_mla_with_kvcache")
    names, required = published_parameters(function)
    gpu_test = pathlib.Path(__file__).parent / "test_sparse_v4_gpu.py"
    used = adapter_keywords(gpu_test, "test_flashmla_reads_the_package_v4_cache_as_reference_does",
                            "flash_mla_with_kvcache")
    assert used <= set(names), used - set(names)
    assert {"use_legacy", "kv_format", "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length"} <= used
    assert required <= used | {"q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata"}
    doc = ast.get_docstring(function)
    assert "528 (V4.1 fp8) or 288 (V4.1 fp4" in doc
    assert "the even-indexed one in the low nibble" in doc and "each covering 32 consecutive" in doc
    assert cf.FP8_DS_MLA_V41.values_per_scale == 32 and cf.FP4_DS_MLA_V41.values_per_scale == 16
