"""ROCM_AITER sparse MLA (sparse_decode, sparse_prefill) on the CPU: aiter's `mla_decode_fwd` with one
request per query token, against the PyTorch stand-in of aiter (tests/fake_aiter) on impersonated MI300X
(gfx942) and MI355X (gfx950), checked against the REFERENCE sparse semantics in float64; the index
conversion, selection with reasons, and the adapter's call against aiter's published source.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import pathlib
import re
import sys
import zipfile

import pytest
import torch
from published import adapter_keywords, published_distribution, published_parameters

import mla_multi as mm
from mla_multi import checks, errors, registry
from mla_multi.backends import rocm_aiter
from mla_multi.backends.base import SparseSelectorConfig
from mla_multi.backends.reference import ReferenceSparseDecodeImpl, sparse_attention_reference
from mla_multi.dims import MLADims
from mla_multi.platforms import SPECS, override
from mla_multi.testing import relative_error

AITER_PUBLISHED = "amd-aiter==0.1.7.post2.dev18"
FAKE_AITER = pathlib.Path(__file__).parent / "fake_aiter"
ADAPTER_SOURCE = pathlib.Path(rocm_aiter.__file__)
FAKE_LABEL = "aiter 0.1.20.post1+fake"
LKV, ROPE = 512, 64
PLATFORMS = ["MI300X", "MI355X"]


# --------------------------------------------------------------------------- the stand-in aiter


def _forget_aiter() -> dict:
    return {name: sys.modules.pop(name) for name in list(sys.modules) if name == "aiter" or name.startswith("aiter.")}


@pytest.fixture
def aiter_on_path(monkeypatch):
    """Put a directory holding an `aiter` package first on sys.path; restore everything after.

    Selections are cached per configuration and platform: the registry forgets them on both sides."""
    saved = _forget_aiter()
    registry.default_registry.clear_cache()

    def install(directory: pathlib.Path) -> None:
        _forget_aiter()
        monkeypatch.syspath_prepend(str(directory))
        rocm_aiter.clear_probe_cache()
        registry.default_registry.clear_cache()

    yield install
    _forget_aiter()
    sys.modules.update(saved)
    rocm_aiter.clear_probe_cache()
    registry.default_registry.clear_cache()


@pytest.fixture
def fake_aiter(aiter_on_path):
    aiter_on_path(FAKE_AITER)
    import aiter.mla

    aiter.mla.CALLS.clear()
    return aiter


@pytest.fixture
def missing_aiter(aiter_on_path, monkeypatch):
    aiter_on_path(FAKE_AITER.parent / "no-such-directory")
    monkeypatch.setitem(sys.modules, "aiter", None)  # import aiter -> ModuleNotFoundError
    rocm_aiter.clear_probe_cache()


@pytest.fixture
def recorded(fake_aiter, monkeypatch):
    """The fake's mla_decode_fwd (aiter v0.1.20.post1's signature) behind a recorder: each call's index tensors
    are kept, and `o` is poisoned with NaN before the fake writes it (aiter's output buffer holds whatever was
    there)."""
    base = fake_aiter.mla.mla_decode_fwd
    calls = []

    @functools.wraps(base)
    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, **kwargs):
        calls.append(dict(kv_indptr=kv_indptr.clone(), kv_indices=kv_indices.clone(), qo_indptr=qo_indptr.clone(),
                          num_rows=kv_buffer.shape[0], nhead=o.shape[1], max_seqlen_q=max_seqlen_q,
                          num_kv_splits=kwargs.get("num_kv_splits"), return_lse=kwargs.get("return_lse", False)))
        o.fill_(float("nan"))
        return base(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, **kwargs)

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", mla_decode_fwd)
    rocm_aiter.clear_probe_cache()
    return calls


@pytest.fixture
def aiter_with_lse(recorded, fake_aiter):
    """aiter v0.1.20.post1 returns the LSE (`return_lse`); the split-KV path writes it with two or more splits."""
    assert rocm_aiter.AiterSparseDecodeBackend.provides_lse()
    return fake_aiter


@pytest.fixture
def legacy_aiter(fake_aiter, monkeypatch):
    """An aiter whose mla_decode_fwd has no return_lse (amd-aiter 0.1.7's signature)."""
    calls = []

    def mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q,
                       sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None,
                       work_meta_data=None, work_indptr=None, work_info_set=None, reduce_indptr=None,
                       reduce_final_map=None, reduce_partial_map=None, q_scale=None, kv_scale=None):
        calls.append(max_seqlen_q)
        raise AssertionError("not called in these tests")

    monkeypatch.setattr(fake_aiter.mla, "mla_decode_fwd", mla_decode_fwd)
    rocm_aiter.clear_probe_cache()
    assert not rocm_aiter.AiterSparseDecodeBackend.provides_lse()
    return calls


@pytest.fixture(autouse=True)
def clean_error_flag():
    errors.error_flag("cpu").zero_()
    yield
    errors.error_flag("cpu").zero_()


# --------------------------------------------------------------------------- cases


def _cache_case(generator, num_slots, block_size):
    return torch.randn(num_slots // block_size, block_size, LKV + ROPE, generator=generator).to(torch.bfloat16)


def _queries(generator, tokens, heads):
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16)
    return q_nope, q_pe


def _index_case(generator, tokens, topk, num_slots):
    """Indices with -1 entries, duplicates, a token with no valid index, a topk_length that cuts lists
    short (0 for one token) and entries past it that name slots nothing else reads (poisoned below)."""
    idx = torch.randint(0, num_slots // 2, (tokens, topk), generator=generator, dtype=torch.int32)
    idx[torch.rand(tokens, topk, generator=generator) < 0.25] = -1
    idx[1, :] = -1  # no valid index: 0 and -inf
    idx[2, 0] = max(int(idx[2, 0]), 0)
    idx[2, 3:7] = idx[2, 0]  # duplicates count twice
    lengths = torch.full((tokens,), topk, dtype=torch.int32)
    lengths[0] = topk // 3
    lengths[3 % tokens] = 0
    # past the length: slots of the upper half, which no counted entry names
    idx[0, topk // 3:] = torch.randint(num_slots // 2, num_slots, (topk - topk // 3,), generator=generator,
                                       dtype=torch.int32)
    return idx, lengths


def _poison_unread(cache: torch.Tensor, num_slots: int) -> torch.Tensor:
    """NaN in every slot of the upper half: slots only invalid entries name."""
    flat = cache.view(-1, cache.shape[-1]).clone()
    flat[num_slots // 2:] = float("nan")
    return flat.view(cache.shape)


def _reference(q_nope, q_pe, rows, indices, scale, topk_length=None, attn_sink=None, decode=True):
    """REFERENCE sparse semantics in float64: (out [T, N, 512], lse [T, N])."""
    q = torch.cat([q_nope, q_pe], dim=-1).double()
    out, lse, _ = sparse_attention_reference(q, rows.double(), indices, scale, topk_length=topk_length,
                                             attn_sink=attn_sink, bad_is_error=decode)
    return out, lse


def _impl(cls, heads):
    return cls(heads, LKV, ROPE)


# --------------------------------------------------------------------------- the index conversion


def _expected_lists(indices, num_rows, topk_length):
    lists = []
    for t in range(indices.shape[0]):
        count = indices.shape[1] if topk_length is None else int(topk_length[t])
        lists.append([int(i) for i in indices[t, :max(count, 0)].tolist() if 0 <= int(i) < num_rows])
    return lists


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("tokens,topk", [(1, 1), (5, 7), (9, 64)])
def test_sparse_kv_indices_compact_valid_entries_in_order(tokens, topk, with_lengths):
    generator = torch.Generator().manual_seed(tokens * 100 + topk)
    num_rows = 40
    indices = torch.randint(-3, num_rows + 5, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[0, : (topk + 1) // 2] = -1
    if topk > 3:
        indices[-1, 1:4] = indices[-1, 0].clamp(0, num_rows - 1)  # duplicates stay
        indices[-1, 0] = indices[-1, 1]
    lengths = torch.randint(-1, topk + 2, (tokens,), generator=generator, dtype=torch.int32) if with_lengths else None
    result = rocm_aiter.sparse_kv_indices(indices, num_rows, lengths)
    lists = _expected_lists(indices, num_rows, lengths)
    counts = [len(row) for row in lists]
    assert result.counts.tolist() == counts
    assert result.kv_indptr.tolist() == [0] + torch.cumsum(torch.tensor(counts), 0).tolist()
    assert result.qo_indptr.tolist() == list(range(tokens + 1))
    assert result.kv_last_page_lens.tolist() == [1] * tokens
    total = sum(counts)
    assert result.kv_indices.shape == (tokens * topk,)
    assert result.kv_indices[:total].tolist() == [i for row in lists for i in row]
    assert not result.kv_indices[total:].any(), "the tail past kv_indptr[T] is zero"
    assert all(t.dtype == torch.int32 for t in (result.qo_indptr, result.kv_indptr, result.kv_indices,
                                                 result.kv_last_page_lens, result.counts))
    # an index outside [-1, num_rows) marks its token wherever it stands, topk_length or not
    expected_bad = [any(int(i) < -1 or int(i) >= num_rows for i in row) for row in indices.tolist()]
    assert result.bad.tolist() == expected_bad
    assert rocm_aiter.sparse_kv_indices(indices, num_rows, lengths, out_of_range_is_bad=False).bad is None


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("tokens,topk", [(1, 1), (5, 7), (9, 64)])
def test_sparse_kv_indices_by_token(tokens, topk, with_lengths):
    """aiter's persistent sparse layout: token t's valid entries, in order, from t * topk; counts as packed."""
    generator = torch.Generator().manual_seed(tokens * 100 + topk + 1)
    num_rows = 40
    indices = torch.randint(-3, num_rows + 5, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[0, : (topk + 1) // 2] = -1
    lengths = torch.randint(-1, topk + 2, (tokens,), generator=generator, dtype=torch.int32) if with_lengths else None
    packed = rocm_aiter.sparse_kv_indices(indices, num_rows, lengths)
    result = rocm_aiter.sparse_kv_indices(indices, num_rows, lengths, by_token=True)
    lists = _expected_lists(indices, num_rows, lengths)
    assert result.kv_indices.shape == (tokens * topk,)
    for t, row in enumerate(lists):
        assert result.kv_indices[t * topk:t * topk + len(row)].tolist() == row
    for name in ("qo_indptr", "kv_indptr", "kv_last_page_lens", "counts", "bad"):
        assert torch.equal(getattr(result, name), getattr(packed, name)), name


def test_sparse_decode_on_aiters_persistent_sparse_metadata(recorded, fake_aiter):
    """MI355X: get_mla_metadata_info_v1(is_sparse=True), get_mla_metadata_v1(topk=, max_split_per_batch=),
    then mla_decode_fwd over those buffers with an explicit num_kv_splits, as aiter's op_tests/test_mla_sparse.py
    runs it; the stand-in reads token t's min(count, topk) entries from t * topk."""
    generator = torch.Generator().manual_seed(11)
    tokens, topk, num_slots, scale, num_heads = 5, 48, 256, 0.0417, 16
    cache = _cache_case(generator, num_slots, 16)
    q_nope, q_pe = _queries(generator, tokens, num_heads)
    indices, lengths = _index_case(generator, tokens, topk, num_slots)
    impl = _impl(rocm_aiter.AiterSparseDecodeImpl, num_heads)
    fake_aiter.ops.attention.CALLS.clear()
    with override("MI355X"):
        out, lse = impl.forward(q_nope, q_pe, cache, indices, scale, topk_length=lengths)
    ref, ref_lse = _reference(q_nope, q_pe, cache.view(-1, LKV + ROPE), indices, scale, lengths)
    assert relative_error(out, ref) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
    info, plan = fake_aiter.ops.attention.CALLS
    assert info["function"] == "get_mla_metadata_info_v1" and info["is_sparse"] and info["batch_size"] == tokens
    assert plan["function"] == "get_mla_metadata_v1" and plan["topk"] == topk and plan["page_size"] == 1
    (call,) = recorded
    expected = rocm_aiter.sparse_kv_indices(indices, num_slots, lengths, by_token=True)
    assert torch.equal(call["kv_indices"], expected.kv_indices) and torch.equal(call["kv_indptr"], expected.kv_indptr)
    assert call["num_kv_splits"] == rocm_aiter.AITER_SPARSE_PERSISTENT_SPLITS and call["max_seqlen_q"] == 1
    assert fake_aiter.mla.CALLS[-1]["persistent"] and not fake_aiter.mla.CALLS[-1]["gated"]


def test_the_stand_in_refuses_sparse_metadata_that_aiters_gate_would_drop(fake_aiter):
    """With num_kv_splits=None aiter's batch gate may send a call to the split-KV path, which ignores the
    metadata and so the topk layout: the adapter always passes num_kv_splits, and the stand-in checks it."""
    attention = fake_aiter.ops.attention
    tokens, heads, topk = 64, 16, 4
    with override("MI355X"):
        specs = attention.get_mla_metadata_info_v1(tokens, 1, heads, torch.bfloat16, torch.bfloat16, True)
        work = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
        qo = torch.arange(tokens + 1, dtype=torch.int32)
        kv = qo * topk
        ones = torch.ones(tokens, dtype=torch.int32)
        attention.get_mla_metadata_v1(qo, kv, ones, heads, 1, True, work[0], work[2], work[1], *work[3:],
                                      max_seqlen_qo=1, uni_seqlen_qo=1, topk=topk, dtype_q=torch.bfloat16,
                                      dtype_kv=torch.bfloat16)
        q = torch.zeros(tokens, heads, LKV + ROPE, dtype=torch.bfloat16)
        o = torch.empty(tokens, heads, LKV, dtype=torch.bfloat16)
        kv_buffer = torch.zeros(8, 1, 1, LKV + ROPE, dtype=torch.bfloat16)
        with pytest.raises(AssertionError, match="aiter's batch gate drops the topk"):
            fake_aiter.mla.mla_decode_fwd(q, kv_buffer, o, qo, kv, torch.zeros(tokens * topk, dtype=torch.int32),
                                          ones, 1, work_meta_data=work[0], work_indptr=work[1],
                                          work_info_set=work[2], reduce_indptr=work[3], reduce_final_map=work[4],
                                          reduce_partial_map=work[5])


def test_sparse_kv_indices_never_read_data_back():
    """Built on the meta device: any host read of the data (a sync on a GPU) or a data-dependent shape
    (boolean-mask indexing, nonzero) would raise."""
    indices = torch.empty(8, 2048, dtype=torch.int32, device="meta")
    lengths = torch.empty(8, dtype=torch.int32, device="meta")
    result = rocm_aiter.sparse_kv_indices(indices, 1 << 20, lengths)
    assert result.kv_indices.shape == (8 * 2048,) and result.kv_indptr.shape == (9,)
    assert result.bad.shape == (8,) and result.counts.shape == (8,)


@pytest.mark.gpu
def test_sparse_kv_indices_do_not_synchronise_on_a_gpu():
    generator = torch.Generator().manual_seed(0)
    indices = torch.randint(-2, 5000, (64, 2048), generator=generator, dtype=torch.int32).cuda()
    lengths = torch.randint(0, 2049, (64,), generator=generator, dtype=torch.int32).cuda()
    rocm_aiter.sparse_kv_indices(indices, 4096, lengths)  # warm-up: first-use allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = rocm_aiter.sparse_kv_indices(indices, 4096, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = rocm_aiter.sparse_kv_indices(indices.cpu(), 4096, lengths.cpu())
    assert torch.equal(result.kv_indptr.cpu(), expected.kv_indptr)
    total = int(expected.kv_indptr[-1])
    assert torch.equal(result.kv_indices.cpu()[:total], expected.kv_indices[:total])
    assert torch.equal(result.bad.cpu(), expected.bad)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [8, 16, 128])
def test_sparse_decode_matches_reference(recorded, fake_aiter, platform, block_size, num_heads):
    generator = torch.Generator().manual_seed(block_size * 1000 + num_heads)
    tokens, topk, num_slots, scale = 5, 48, 256, 0.0417
    cache = _cache_case(generator, num_slots, block_size)
    q_nope, q_pe = _queries(generator, tokens, num_heads)
    indices, lengths = _index_case(generator, tokens, topk, num_slots)
    poisoned = _poison_unread(cache, num_slots)
    impl = _impl(rocm_aiter.AiterSparseDecodeImpl, num_heads)
    for topk_length in (None, lengths):
        recorded.clear()
        with override(platform):
            out, lse = impl.forward(q_nope, q_pe, poisoned if topk_length is not None else cache, indices, scale,
                                    topk_length=topk_length)
        ref, ref_lse = _reference(q_nope, q_pe, cache.view(-1, LKV + ROPE), indices, scale, topk_length)
        assert out.shape == (tokens, num_heads, LKV) and out.dtype == torch.bfloat16
        assert relative_error(out, ref) < 1e-2
        assert torch.equal(out[1], torch.zeros_like(out[1])), "a token with no valid index gives 0"
        if topk_length is not None:
            assert torch.equal(out[3], torch.zeros_like(out[3])), "topk_length 0 gives 0"
        # the LSE, written by aiter's second stage (at least two splits are asked for)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
        # one request per query token, page size 1, the heads of a kernel of aiter's tables
        (call,) = recorded
        assert call["qo_indptr"].tolist() == list(range(tokens + 1))
        assert call["max_seqlen_q"] == 1 and call["num_rows"] == num_slots
        # gfx950: aiter's persistent sparse metadata where a persistent bf16 kernel writes the LSE (not 8 heads);
        # gfx942 has no such kernel: the split-KV path with at least two splits
        persistent = platform == "MI355X" and num_heads != 8
        splits = rocm_aiter.AITER_SPARSE_PERSISTENT_SPLITS if persistent else rocm_aiter.AITER_NON_PERSISTENT_SPLITS
        assert call["nhead"] == num_heads and call["num_kv_splits"] == splits
        assert fake_aiter.mla.CALLS[-1]["lse_written"] and fake_aiter.mla.CALLS[-1]["persistent"] == persistent
    assert rocm_aiter.AiterSparseDecodeBackend.provides_lse()
    assert errors.pending_errors("cpu") == 0
    # the scale is always passed (aiter's default 1/sqrt(576) is wrong for MLA)
    assert [c["sm_scale"] for c in fake_aiter.mla.CALLS] == [scale, scale]


def test_sparse_decode_agrees_with_the_reference_impl(recorded):
    """The REFERENCE backend's own impl on the same bfloat16 inputs (its float32 arithmetic)."""
    generator = torch.Generator().manual_seed(7)
    cache = _cache_case(generator, 128, 16)
    q_nope, q_pe = _queries(generator, 6, 16)
    indices, lengths = _index_case(generator, 6, 32, 128)
    out, _ = _impl(rocm_aiter.AiterSparseDecodeImpl, 16).forward(q_nope, q_pe, cache, indices, 0.05,
                                                                   topk_length=lengths)
    ref, ref_lse = ReferenceSparseDecodeImpl(16, LKV, ROPE).forward(q_nope, q_pe, cache, indices, 0.05,
                                                                     topk_length=lengths)
    assert relative_error(out, ref) < 1e-2
    empty = torch.isinf(ref_lse).all(dim=1)
    assert empty[1] and empty[3] and not empty[0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sparse_decode_lse_and_sink_where_aiter_returns_the_lse(aiter_with_lse, platform):
    generator = torch.Generator().manual_seed(11)
    tokens, heads, topk, num_slots, scale = 6, 8, 40, 192, 0.043
    cache = _cache_case(generator, num_slots, 16)
    q_nope, q_pe = _queries(generator, tokens, heads)
    indices, lengths = _index_case(generator, tokens, topk, num_slots)
    sink = torch.tensor([0.5, -math.inf, math.inf, -2.0, 3.0, 0.0, -math.inf, 1.5])
    impl = _impl(rocm_aiter.AiterSparseDecodeImpl, heads)
    for topk_length, attn_sink in ((None, None), (lengths, None), (None, sink), (lengths, sink)):
        with override(platform):
            out, lse = impl.forward(q_nope, q_pe, _poison_unread(cache, num_slots) if topk_length is not None else cache,
                                    indices, scale, topk_length=topk_length, attn_sink=attn_sink)
        ref, ref_lse = _reference(q_nope, q_pe, cache.view(-1, LKV + ROPE), indices, scale, topk_length, attn_sink)
        assert lse.shape == (tokens, heads) and lse.dtype == torch.float32
        assert relative_error(out, ref) < 1e-2
        assert torch.equal(lse[1], torch.full((heads,), -math.inf)), "no valid index: LSE -inf"
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
        if attn_sink is not None:
            # +inf sink: all weight on the sink; -inf: no effect
            assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))
            plain, _ = impl.forward(q_nope, q_pe, cache, indices, scale, topk_length=topk_length)
            assert torch.equal(out[:, 1], plain[:, 1]) and torch.equal(out[:, 6], plain[:, 6])


def test_a_sink_without_an_lse_is_a_value_error(legacy_aiter):
    generator = torch.Generator().manual_seed(2)
    cache = _cache_case(generator, 64, 16)
    q_nope, q_pe = _queries(generator, 2, 16)
    indices = torch.randint(0, 64, (2, 8), generator=generator, dtype=torch.int32)
    for cls in (rocm_aiter.AiterSparseDecodeImpl, rocm_aiter.AiterSparsePrefillImpl):
        kv = cache if cls is rocm_aiter.AiterSparseDecodeImpl else cache.view(-1, LKV + ROPE)
        expected = rf"attn_sink with ROCM_AITER sparse_\w+ on {re.escape(FAKE_LABEL)}.*no return_lse"
        with pytest.raises(ValueError, match=expected):
            _impl(cls, 16).forward(q_nope, q_pe, kv, indices, 0.1, attn_sink=torch.zeros(16))
    assert legacy_aiter == [], "refused before aiter is called"
    info = rocm_aiter.AiterSparseDecodeBackend.info()
    assert info["returns_lse"] is False and info["attn_sink"].startswith("needs an aiter with return_lse")
    assert info["cuda_graphs"] is True and info["aiter_version"] == "0.1.20.post1+fake"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_sparse_decode_with_several_query_tokens_through_the_ops(recorded, platform):
    """q [B, Q, N, 512] and indices [B, Q, topk] through mm.ops.mla_sparse_decode: the tokens are flattened,
    topk_length is per request."""
    generator = torch.Generator().manual_seed(21)
    batch, q_len, heads, topk, num_slots, scale = 3, 4, 16, 32, 256, 0.05
    cache = _cache_case(generator, num_slots, 64)
    q_nope = torch.randn(batch, q_len, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(batch, q_len, heads, ROPE, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, num_slots, (batch, q_len, topk), generator=generator, dtype=torch.int32)
    indices[1, 2] = -1
    lengths = torch.tensor([32, 9, 0], dtype=torch.int32)
    with override(platform):
        out = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, scale, topk_length=lengths)
        chosen = registry.select_sparse_backend("sparse_decode", MLADims.deepseek_v3(heads), torch.bfloat16,
                                                torch.bfloat16, topk, max_query_len=q_len)
    assert chosen.name == "ROCM_AITER"
    assert len(recorded) == 1 and recorded[0]["qo_indptr"].numel() == batch * q_len + 1
    ref, _ = _reference(q_nope.view(-1, heads, LKV), q_pe.view(-1, heads, ROPE), cache.view(-1, LKV + ROPE),
                        indices.view(-1, topk), scale, lengths.repeat_interleave(q_len))
    assert out.shape == (batch, q_len, heads, LKV)
    assert relative_error(out.view(-1, heads, LKV), ref) < 1e-2
    assert torch.equal(out[1, 2], torch.zeros_like(out[1, 2])) and torch.equal(out[2], torch.zeros_like(out[2]))


def test_sparse_decode_ops_with_lse_and_sink(aiter_with_lse):
    generator = torch.Generator().manual_seed(23)
    batch, q_len, heads, topk = 2, 2, 16, 24
    cache = _cache_case(generator, 128, 16)
    q_nope = torch.randn(batch, q_len, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(batch, q_len, heads, ROPE, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 128, (batch, q_len, topk), generator=generator, dtype=torch.int32)
    sink = torch.linspace(-3, 3, heads)
    with override("MI355X"):
        out, lse = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.06, attn_sink=sink, return_lse=True)
        ref_out, ref_lse = mm.ops.mla_sparse_decode(q_nope.float(), q_pe.float(), cache.float(), indices, 0.06,
                                                    attn_sink=sink, return_lse=True, backend="REFERENCE")
    assert out.shape == (batch, q_len, heads, LKV) and lse.shape == (batch, q_len, heads)
    assert relative_error(out, ref_out) < 1e-2
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_bad_indices_give_nan_rows_and_the_error_flag_with_checks_off(recorded, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    cache = _cache_case(generator, 16, 8)
    q_nope, q_pe = _queries(generator, 4, 16)
    indices = torch.tensor([[0, 1, -1], [16, 2, 3], [-2, 4, 5], [6, 7, 99]], dtype=torch.int32)
    lengths = torch.tensor([3, 3, 3, 2], dtype=torch.int32)  # 99 lies past token 3's length: still bad data
    # with the data checks (always on the CPU) the op layer raises
    with override("MI300X"), pytest.raises(ValueError, match=r"indices hold \[16, -2, 99\]"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.1)
    assert recorded == []
    # without them (as on a GPU): NaN rows for the bad tokens, the others exact, the flag set on the device
    monkeypatch.setattr(checks, "data_checks_enabled", lambda device=None: False)
    with override("MI300X"):
        out = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.1, topk_length=lengths)
    assert torch.isnan(out[1:]).all()
    ref, _ = _reference(q_nope[:1], q_pe[:1], cache.view(-1, LKV + ROPE), indices[:1], 0.1)
    assert relative_error(out[:1], ref) < 1e-2
    # bad entries never reach aiter
    (call,) = recorded
    passed = call["kv_indices"][: int(call["kv_indptr"][-1])]
    assert passed.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert errors.pending_errors("cpu") == errors.SPARSE_INDEX
    with pytest.raises(ValueError, match="sparse decode index"):
        mm.ops.raise_pending_errors("cpu")
    # a clean call sets nothing
    out = _impl(rocm_aiter.AiterSparseDecodeImpl, 16).forward(q_nope, q_pe, cache, indices.clamp(-1, 15), 0.1)[0]
    assert torch.isfinite(out).all() and errors.pending_errors("cpu") == 0


def test_bad_indices_with_the_lse(aiter_with_lse):
    generator = torch.Generator().manual_seed(4)
    cache = _cache_case(generator, 32, 16)
    q_nope, q_pe = _queries(generator, 3, 16)
    indices = torch.tensor([[0, 1, -1], [32, 2, 3], [-1, -1, -1]], dtype=torch.int32)
    out, lse = _impl(rocm_aiter.AiterSparseDecodeImpl, 16).forward(q_nope, q_pe, cache, indices, 0.1,
                                                                   attn_sink=torch.zeros(16))
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(lse[2], torch.full((16,), -math.inf))
    assert errors.pending_errors("cpu") == errors.SPARSE_INDEX


def test_the_adapter_reads_nothing_back_to_the_host(recorded, monkeypatch):
    """Every host read of tensor data (item, tolist, bool, int, float) raises inside the adapter; the fake
    aiter itself, which loops on the host, runs with them restored."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    real = {name: getattr(torch.Tensor, name) for name in names}
    own = {name: name in vars(torch.Tensor) for name in names}

    def forbidden(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} called by the adapter: a host synchronisation on a GPU")
        return read

    def restore():
        for name, method in real.items():
            if own[name]:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)

    @contextlib.contextmanager
    def guarded():
        for name in names:
            setattr(torch.Tensor, name, forbidden(name))
        try:
            yield
        finally:
            restore()

    import aiter.mla

    inner = aiter.mla.mla_decode_fwd

    def unguarded_aiter(*args, **kwargs):
        restore()
        try:
            return inner(*args, **kwargs)
        finally:
            for name in names:
                setattr(torch.Tensor, name, forbidden(name))

    monkeypatch.setattr(aiter.mla, "mla_decode_fwd", unguarded_aiter)
    generator = torch.Generator().manual_seed(5)
    cache = _cache_case(generator, 128, 16)
    q_nope, q_pe = _queries(generator, 4, 8)
    indices, lengths = _index_case(generator, 4, 32, 128)
    indices[2, 5] = 500  # a bad index: the NaN rows and the flag are set on the device too
    errors.error_flag("cpu")
    with guarded():
        out, _ = _impl(rocm_aiter.AiterSparseDecodeImpl, 8).forward(q_nope, q_pe, cache, indices, 0.1,
                                                                    topk_length=lengths)
        _impl(rocm_aiter.AiterSparsePrefillImpl, 8).forward(q_nope, q_pe, cache.view(-1, LKV + ROPE), indices, 0.1,
                                                           topk_length=lengths)
    with pytest.raises(AssertionError, match="Tensor.item"), guarded():
        torch.zeros(1).item()  # the guard does fire
    assert len(recorded) == 2 and torch.isnan(out[2]).all()
    assert errors.pending_errors("cpu") == errors.SPARSE_INDEX


def test_tokens_without_entries_skip_aiter(recorded):
    generator = torch.Generator().manual_seed(6)
    cache = _cache_case(generator, 32, 16)
    q_nope, q_pe = _queries(generator, 0, 16)
    out, lse = _impl(rocm_aiter.AiterSparseDecodeImpl, 16).forward(q_nope, q_pe, cache,
                                                                   torch.zeros(0, 8, dtype=torch.int32), 0.1)
    assert out.shape == (0, 16, LKV) and lse.shape == (0, 16) and recorded == []


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("num_heads", [4, 16, 128])
def test_sparse_prefill_matches_reference(recorded, platform, num_heads):
    generator = torch.Generator().manual_seed(num_heads)
    tokens, topk, rows, scale = 6, 40, 50, 0.03
    kv = torch.randn(rows, LKV + ROPE, generator=generator).to(torch.bfloat16)
    q_nope, q_pe = _queries(generator, tokens, num_heads)
    indices = torch.randint(-3, rows + 20, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[4] = rows  # only out-of-range entries: no token
    indices[5, :10] = indices[5, 10].clamp(0, rows - 1)  # duplicates
    lengths = torch.tensor([40, 3, 0, 39, 40, 21], dtype=torch.int32)
    impl = _impl(rocm_aiter.AiterSparsePrefillImpl, num_heads)
    for topk_length in (None, lengths):
        recorded.clear()
        with override(platform):
            out, lse = impl.forward(q_nope, q_pe, kv, indices, scale, topk_length=topk_length)
        ref, ref_lse = _reference(q_nope, q_pe, kv, indices, scale, topk_length, decode=False)
        assert out.shape == (tokens, num_heads, LKV) and lse.shape == (tokens, num_heads)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
        assert relative_error(out, ref) < 1e-2
        assert torch.equal(out[4], torch.zeros_like(out[4]))
        (call,) = recorded
        assert call["num_rows"] == rows and call["max_seqlen_q"] == 1
        passed = call["kv_indices"][: int(call["kv_indptr"][-1])]
        assert bool(((passed >= 0) & (passed < rows)).all())
    assert errors.pending_errors("cpu") == 0, "out-of-range prefill indices are no token, not an error"


def test_sparse_prefill_through_the_ops_with_lse_and_sink(aiter_with_lse):
    generator = torch.Generator().manual_seed(8)
    tokens, heads, topk, rows = 5, 16, 30, 60
    kv = torch.randn(rows, LKV + ROPE, generator=generator).to(torch.bfloat16)
    q_nope, q_pe = _queries(generator, tokens, heads)
    indices = torch.randint(-1, rows + 10, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[2] = -1
    lengths = torch.tensor([30, 7, 30, 0, 18], dtype=torch.int32)
    sink = torch.linspace(-2, 2, heads)
    sink[3], sink[9] = math.inf, -math.inf
    with override("MI300X"):
        out, lse = mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, indices, 0.045, topk_length=lengths, attn_sink=sink,
                                             return_lse=True)
        chosen = registry.select_sparse_backend("sparse_prefill", MLADims.deepseek_v3(heads), torch.bfloat16,
                                                torch.bfloat16, topk)
    assert chosen.name == "ROCM_AITER"
    ref, ref_lse = _reference(q_nope, q_pe, kv, indices, 0.045, lengths, sink, decode=False)
    assert relative_error(out, ref) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))


def test_non_contiguous_prefill_rows_and_bad_layouts(recorded):
    generator = torch.Generator().manual_seed(9)
    wide = torch.randn(30, 700, generator=generator).to(torch.bfloat16)
    kv = wide[:, : LKV + ROPE]  # rows with a stride of 700
    q_nope, q_pe = _queries(generator, 3, 16)
    indices = torch.randint(0, 30, (3, 12), generator=generator, dtype=torch.int32)
    out, _ = _impl(rocm_aiter.AiterSparsePrefillImpl, 16).forward(q_nope, q_pe, kv, indices, 0.1)
    ref, _ = _reference(q_nope, q_pe, kv, indices, 0.1, decode=False)
    assert relative_error(out, ref) < 1e-2
    decode = _impl(rocm_aiter.AiterSparseDecodeImpl, 16)
    with pytest.raises(ValueError, match="bfloat16 cache"):
        decode.forward(q_nope, q_pe, kv.float().reshape(3, 10, -1), indices, 0.1)
    with pytest.raises(ValueError, match="not contiguous"):
        decode.forward(q_nope, q_pe, wide[:, : LKV + ROPE].reshape(3, 10, -1)[:, ::2], indices, 0.1)
    with pytest.raises(ValueError, match="accepted by ROCM_AITER: bfloat16"):
        decode.forward(q_nope.half(), q_pe.half(), kv.contiguous().view(3, 10, -1), indices, 0.1)


# --------------------------------------------------------------------------- selection


def _config(heads, kv_dtype, dtype=torch.bfloat16, topk=2048, max_query_len=1):
    return SparseSelectorConfig(MLADims.deepseek_v3(heads), dtype, kv_dtype, topk, max_query_len)


def _fallback(phase, config, spec) -> str:
    """The backend after ROCM_AITER in the platform's list that can run `config` (ROCM_AITER has reasons)."""
    order = registry.default_registry.priority(phase, spec, config)
    assert order[0] == "ROCM_AITER" and registry.default_registry.reasons(phase, "ROCM_AITER", spec, config)
    return next(name for name in order[1:] if not registry.default_registry.reasons(phase, name, spec, config))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("phase", ["sparse_decode", "sparse_prefill"])
def test_selection_picks_rocm_aiter_for_bfloat16(fake_aiter, platform, phase):
    spec = SPECS[platform]
    assert registry.default_registry.priority(phase, spec)[0] == "ROCM_AITER"
    for heads in (4, 8, 16, 20, 32, 128) + ((48, 64) if spec.arch == "gfx950" else ()):
        for max_query_len in (1, 4):
            config = _config(heads, torch.bfloat16, max_query_len=max_query_len)
            assert registry.default_registry.select(phase, config, spec).name == "ROCM_AITER"
            assert registry.default_registry.reasons(phase, "ROCM_AITER", spec, config) == []
    # 48 and 64 heads on gfx942: aiter's split-KV mla_decode_fwd has no kernel (gfx950 pads 48 to 64); the next
    # backend in the list
    supported = "8, 16, 32, 128 on gfx942"
    for heads in (48, 64) if spec.arch == "gfx942" else ():
        config = _config(heads, torch.bfloat16)
        assert registry.default_registry.select(phase, config, spec).name == _fallback(phase, config, spec)
        assert registry.default_registry.reasons(phase, "ROCM_AITER", spec, config) == [
            f"num_heads {heads} is not supported by {FAKE_LABEL} on {platform} ({spec.arch})'s mla_decode_fwd "
            f"(split-KV, one bfloat16 query token a request); supported: {supported}; other counts padded to a "
            "multiple of 16 that runs"
        ]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_fp8_and_fp8_ds_mla_caches_are_reasons(fake_aiter, platform):
    spec = SPECS[platform]
    where = f"{FAKE_LABEL} on {platform} ({spec.arch})"
    future = ("possible future paths in aiter's source: hk_mla_v32_decode_fwd, HipKittens' DeepSeek V3.2 decode kernel "
              "(FP8 query and cache, heads x query tokens = 128, or 64 on gfx950; gfx942 / gfx950; experimental, behind "
              "mla_decode_fwd's persistent metadata), and mla_decode_fwd_ds32 (gfx950; FP8 NoPE with E8M0 block scales "
              f"and bf16 RoPE in separate buffers); present in {FAKE_LABEL}: mla_decode_fwd_ds32")
    fp8 = spec.fp8_dtype
    config = _config(128, fp8)
    chosen = registry.default_registry.select("sparse_decode", config, spec)
    assert chosen.name == _fallback("sparse_decode", config, spec)
    assert registry.default_registry.reasons("sparse_decode", "ROCM_AITER", spec, config) == [
        f"kv dtype {fp8} is not supported; supported: bfloat16".replace("torch.", ""),
        f"an FP8 cache ({str(fp8).replace('torch.', '')}) is not supported by ROCM_AITER sparse MLA on {where}: the "
        "sparse path passes the bfloat16 query as it is, and mla_decode_fwd reads an FP8 cache only in its a8w8 "
        "kernels (FP8 query with a per-tensor q_scale); " + future,
    ]
    config = _config(128, torch.uint8)
    chosen = registry.default_registry.select("sparse_decode", config, spec)
    assert chosen.name == _fallback("sparse_decode", config, spec)
    assert registry.default_registry.reasons("sparse_decode", "ROCM_AITER", spec, config) == [
        "kv dtype uint8 is not supported; supported: bfloat16",
        "the fp8_ds_mla cache (uint8, 656 bytes a token: FP8 values with a float32 scale per 128, then bf16 rotary "
        f"values) is not supported by ROCM_AITER sparse MLA on {where}: mla_decode_fwd has no kernel that reads "
        "this layout; " + future,
    ]
    half = registry.default_registry.reasons("sparse_prefill", "ROCM_AITER", spec, _config(16, torch.float16,
                                                                                           torch.float16))
    assert half == ["dtype float16 is not supported; supported: bfloat16",
                    "kv dtype float16 is not supported; supported: bfloat16"]


def test_the_fp8_reason_names_a_kernel_the_installed_aiter_has(fake_aiter, monkeypatch):
    monkeypatch.setattr(fake_aiter, "hk_mla_v32_decode_fwd", lambda *args: None, raising=False)
    rocm_aiter.clear_probe_cache()
    reasons = rocm_aiter.AiterSparseDecodeBackend.validate_configuration(SPECS["MI355X"], _config(128, torch.uint8))
    assert reasons[-1].endswith(f"present in {FAKE_LABEL}: hk_mla_v32_decode_fwd, mla_decode_fwd_ds32")


def test_platforms_and_aiter_versions_without_the_sparse_path(fake_aiter, monkeypatch):
    reasons = rocm_aiter.AiterSparseDecodeBackend.validate_configuration
    for other in ("MI250X", "RX7900XTX"):
        assert reasons(SPECS[other], _config(16, torch.bfloat16)) == [
            f"{FAKE_LABEL} has no MLA decode kernels for {other} ({SPECS[other].arch}); supported: gfx942, gfx950"
        ]
    assert reasons(SPECS["H100"], _config(16, torch.bfloat16)) == [
        "platform H100 (cuda sm_90) is not supported; aiter runs on ROCm only"
    ]
    monkeypatch.setattr(rocm_aiter, "_kernel_archs", lambda module: ("gfx942",))
    rocm_aiter.clear_probe_cache()
    assert rocm_aiter.AiterSparsePrefillBackend.validate_configuration(SPECS["MI355X"], _config(16, torch.bfloat16)) == [
        f"{FAKE_LABEL} has no MLA decode kernels for MI355X (gfx950); shipped with kernels: gfx942"
    ]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_selection_without_aiter_falls_back(missing_aiter, platform):
    spec = SPECS[platform]
    for phase in ("sparse_decode", "sparse_prefill"):
        config = _config(16, torch.bfloat16)
        assert registry.default_registry.select(phase, config, spec).name == _fallback(phase, config, spec)
        assert registry.default_registry.reasons(phase, "ROCM_AITER", spec, config) == [
            "aiter is not installed (pip package amd-aiter)"
        ]
    with override(platform), pytest.raises(RuntimeError, match="aiter is not installed"):
        _impl(rocm_aiter.AiterSparseDecodeImpl, 16).forward(
            torch.zeros(1, 16, LKV, dtype=torch.bfloat16), torch.zeros(1, 16, ROPE, dtype=torch.bfloat16),
            torch.zeros(1, 16, LKV + ROPE, dtype=torch.bfloat16), torch.zeros(1, 4, dtype=torch.int32), 0.1)


def test_lse_availability_follows_the_installed_signature(aiter_with_lse):
    for backend in (rocm_aiter.AiterSparseDecodeBackend, rocm_aiter.AiterSparsePrefillBackend):
        assert backend.provides_lse()
        info = backend.info()
        assert info["returns_lse"] is True and info["attn_sink"] == "applied from the LSE"
        assert info["kv_dtypes"] == ["bfloat16"] and info["max_query_len"] == 1 << 16


# --------------------------------------------------------------------------- aiter's published source


@pytest.fixture(scope="session")
def aiter_wheel(pytestconfig) -> pathlib.Path:
    return published_distribution(
        pytestconfig, AITER_PUBLISHED, "amd_aiter", ".whl", "MLA_MULTI_AITER_WHEEL", ("--only-binary", ":all:")
    )


def test_the_sparse_call_is_declared_and_checked_against_published_aiter(aiter_wheel):
    call = rocm_aiter.SPARSE_MLA_DECODE_FWD
    # listed in AITER_CALLS: test_backend_rocm_aiter.py's contract test runs over it
    assert call in rocm_aiter.AITER_CALLS
    # the adapter's one call passes exactly the declared keywords
    passed = adapter_keywords(ADAPTER_SOURCE, "_sparse_mla_decode_fwd", call.function)
    assert passed == set(call.keywords) | set(call.optional_keywords)
    with zipfile.ZipFile(aiter_wheel) as archive:
        tree = ast.parse(archive.read(call.source).decode("utf-8"))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == call.function]
    names, required = published_parameters(node)
    assert set(call.keywords) <= set(names)
    assert required <= set(call.keywords)
    # this release has no return_lse: the adapter passes it only where the signature has it
    assert set(call.optional_keywords) - set(names) == {"return_lse"}
