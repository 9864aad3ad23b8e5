"""Sparse MLA on the GPU: every installed sparse backend (TRITON; FLASHMLA where its wheel is installed)
through mm.ops against float64 on the dequantised cache, index semantics, bad indices, CUDA-graph replay
with new indices, and FLASHMLA's dense decode against REFERENCE."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import errors, registry
from mla_multi.backends.reference import sparse_attention_reference
from mla_multi.dims import MLADims
from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from mla_multi.platforms import current_platform
from mla_multi.testing import capture_graph

pytestmark = pytest.mark.gpu

LKV, ROPE = 512, 64
# against float64 on the dequantised cache: 1e-2 for bf16 products (bf16 and fp8_ds_mla caches); a per-tensor
# FP8 cache runs through the dense decode kernels, whose QK product takes an e4m3 query: their stated 4e-2
BOUND = 1e-2
FP8_QK_BOUND = 4e-2


def _reasons(phase, name, heads, kv_dtype, topk, q_len=1):
    config = registry.sparse_config(MLADims(heads, kv_lora_rank=LKV, qk_rope_head_dim=ROPE), torch.bfloat16, kv_dtype,
                                    topk, max_query_len=q_len)
    return registry.default_registry.reasons(phase, name, current_platform(), config)


def _need(phase, name, heads, kv_dtype, topk, q_len=1):
    reasons = _reasons(phase, name, heads, kv_dtype, topk, q_len)
    if reasons:
        pytest.skip(f"{name} cannot run this case here: {reasons[0]}")


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _cache(kind, num_blocks, block_size, generator, poison_slots=()):
    """(cache on the GPU, its float64 rows [slots, 576] on the CPU, k_scale); `poison_slots` hold NaN."""
    slots = num_blocks * block_size
    kv_c = torch.randn(slots, LKV, generator=generator)
    k_pe = torch.randn(slots, ROPE, generator=generator)
    if kind == "fp8_ds_mla":
        rows = quantize_fp8_ds_mla(kv_c, k_pe)
        poisoned = rows.clone()
        poisoned[list(poison_slots)] = 0xFF  # e4m3fn NaN values, NaN scales and rotary values
        return poisoned.view(num_blocks, block_size, FP8_DS_MLA_BYTES).cuda(), dequantize_fp8_ds_mla(rows, torch.float64), None
    if kind == "fp8":
        cache = (torch.cat([kv_c, k_pe], -1) / 0.05).to(torch.float8_e4m3fn)
        rows = cache.double() * 0.05
        cache = cache.clone()
        cache[list(poison_slots)] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
        return cache.view(num_blocks, block_size, 576).cuda(), rows, 0.05
    cache = torch.cat([kv_c, k_pe], -1).to(torch.bfloat16)
    rows = cache.double()
    cache = cache.clone()
    cache[list(poison_slots)] = float("nan")
    return cache.view(num_blocks, block_size, 576).cuda(), rows, None


def _indices(generator, tokens, topk, usable_slots, minus_one=0.15):
    usable = torch.tensor(usable_slots, dtype=torch.int32)
    idx = usable[torch.randint(0, len(usable_slots), (tokens, topk), generator=generator)]
    idx[torch.rand(tokens, topk, generator=generator) < minus_one] = -1
    return idx


CASES = [
    # (cache kind, heads, block size, topk)
    ("bf16", 128, 64, 2048),
    ("bf16", 16, 16, 192),
    ("bf16", 64, 1, 128),
    ("fp8", 128, 64, 256),
    ("fp8_ds_mla", 128, 64, 2048),
    ("fp8_ds_mla", 64, 16, 192),
    ("fp8_ds_mla", 128, 1, 64),
    ("fp8_ds_mla", 16, 64, 100),
]
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_ds_mla": torch.uint8}


@pytest.mark.parametrize("backend", ["TRITON", "FLASHMLA"])
@pytest.mark.parametrize("kind,heads,block_size,topk", CASES)
def test_sparse_decode_matches_float64(backend, kind, heads, block_size, topk):
    _need("sparse_decode", backend, heads, KV_DTYPES[kind], topk)
    generator = torch.Generator().manual_seed(heads + topk + block_size)
    num_blocks = max(2, 4096 // block_size)
    slots = num_blocks * block_size
    poison = list(range(slots - 64, slots))  # named by no index: a read of them shows as NaN
    cache, rows, k_scale = _cache(kind, num_blocks, block_size, generator, poison)
    tokens = 6
    indices = _indices(generator, tokens, topk, list(range(slots - 64)))
    indices[1] = -1  # nothing to attend to: 0 and -inf
    indices[2, 5:9] = indices[2, 0]  # duplicates count twice
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16)
    lengths = torch.tensor([topk, topk, topk // 2, 0, 1, topk - 7], dtype=torch.int32)
    sink = torch.linspace(-2, 2, heads)
    sink[0], sink[1] = -math.inf, math.inf
    scale = 0.0625
    for topk_length, attn_sink in ((None, None), (lengths, None), (None, sink), (lengths, sink)):
        out, lse = mm.ops.mla_sparse_decode(
            q_nope.cuda(), q_pe.cuda(), cache, indices.cuda(), scale, k_scale=k_scale,
            topk_length=None if topk_length is None else topk_length.cuda(),
            attn_sink=None if attn_sink is None else attn_sink.cuda(), backend=backend, return_lse=True,
        )
        ref, ref_lse, _ = sparse_attention_reference(
            torch.cat([q_nope, q_pe], -1).double(), rows, indices, scale, topk_length=topk_length,
            attn_sink=None if attn_sink is None else attn_sink.double(),
        )
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
        bound = FP8_QK_BOUND if kind == "fp8" else BOUND
        assert _rel(out, ref) < bound, (topk_length is not None, attn_sink is not None)
        lse = lse.cpu().double()
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
        assert bool((lse[1] == -math.inf).all()) and bool((out[1] == 0).all())
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=2e-3, atol=10 * bound)


@pytest.mark.parametrize("backend", ["TRITON", "FLASHMLA"])
def test_sparse_decode_several_query_tokens_per_request(backend):
    _need("sparse_decode", backend, 64, torch.uint8, 256, q_len=2)
    generator = torch.Generator().manual_seed(5)
    cache, rows, _ = _cache("fp8_ds_mla", 32, 64, generator)
    batch, q_len, heads, topk = 3, 2, 64, 256
    indices = _indices(generator, batch * q_len, topk, list(range(32 * 64))).view(batch, q_len, topk)
    q_nope = torch.randn(batch, q_len, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(batch, q_len, heads, ROPE, generator=generator).to(torch.bfloat16)
    lengths = torch.tensor([256, 3, 100], dtype=torch.int32)
    out = mm.ops.mla_sparse_decode(q_nope.cuda(), q_pe.cuda(), cache, indices.cuda(), 0.06,
                                   topk_length=lengths.cuda(), backend=backend)
    assert out.shape == (batch, q_len, heads, LKV)
    ref, _, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1).view(-1, heads, 576).double(), rows,
                                           indices.view(-1, topk), 0.06, topk_length=lengths.repeat_interleave(q_len))
    assert _rel(out.view(-1, heads, LKV), ref) < BOUND


@pytest.mark.parametrize("backend", ["TRITON", "FLASHMLA"])
def test_sparse_decode_bad_indices_give_nan_rows_and_the_flag(backend, monkeypatch):
    _need("sparse_decode", backend, 128, torch.uint8, 128)
    monkeypatch.delenv("MLA_MULTI_CHECK_INPUTS", raising=False)
    generator = torch.Generator().manual_seed(6)
    cache, rows, _ = _cache("fp8_ds_mla", 8, 64, generator)
    indices = _indices(generator, 4, 128, list(range(512)))
    indices[1, 7] = 512  # past the cache
    indices[3, 0] = -2
    q_nope = torch.randn(4, 128, LKV, generator=generator).to(torch.bfloat16).cuda()
    q_pe = torch.randn(4, 128, ROPE, generator=generator).to(torch.bfloat16).cuda()
    try:  # start from a clear flag
        errors.raise_pending_errors("cuda")
    except ValueError:
        pass
    out, lse = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices.cuda(), 0.06, backend=backend, return_lse=True)
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(out[3]).all())
    assert bool(torch.isnan(lse[1]).all()) and bool(torch.isnan(lse[3]).all())
    assert bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(out[2]).all())
    with pytest.raises(ValueError, match="sparse decode index"):
        errors.raise_pending_errors("cuda")


@pytest.mark.parametrize("backend", ["TRITON", "FLASHMLA"])
def test_sparse_decode_replays_from_a_cuda_graph_with_new_indices(backend, monkeypatch):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")  # the data checks read the indices on the host
    _need("sparse_decode", backend, 128, torch.uint8, 512)
    generator = torch.Generator().manual_seed(7)
    cache, rows, _ = _cache("fp8_ds_mla", 64, 64, generator)
    tokens, heads, topk = 8, 128, 512
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16).cuda()
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16).cuda()
    static = _indices(generator, tokens, topk, list(range(4096))).cuda()
    result = {}

    def step():
        result["out"] = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, static, 0.06, backend=backend)

    graph = capture_graph(step)
    for seed in (11, 12):
        fresh = _indices(torch.Generator().manual_seed(seed), tokens, topk, list(range(4096)))
        static.copy_(fresh)
        result["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1).double().cpu(), rows, fresh, 0.06)
        assert _rel(result["out"], ref) < BOUND


PREFILL_CASES = [(128, 2048, 4096), (64, 128, 700), (16, 192, 300), (128, 64, 50)]


@pytest.mark.parametrize("backend", ["TRITON", "FLASHMLA"])
@pytest.mark.parametrize("heads,topk,s_kv", PREFILL_CASES)
def test_sparse_prefill_matches_float64(backend, heads, topk, s_kv):
    _need("sparse_prefill", backend, heads, torch.bfloat16, topk)
    generator = torch.Generator().manual_seed(heads + topk)
    kv = torch.randn(s_kv, 576, generator=generator).to(torch.bfloat16)
    tokens = 5
    indices = torch.randint(-3, s_kv + 40, (tokens, topk), generator=generator, dtype=torch.int32)  # outside = none
    indices[1] = -1
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16)
    lengths = torch.tensor([topk, topk, topk // 3, 0, 1], dtype=torch.int32)
    sink = torch.linspace(-1, 1, heads)
    sink[0] = math.inf
    for topk_length, attn_sink in ((None, None), (lengths, sink)):
        out, lse = mm.ops.mla_sparse_prefill(
            q_nope.cuda(), q_pe.cuda(), kv.cuda(), indices.cuda(), 0.07,
            topk_length=None if topk_length is None else topk_length.cuda(),
            attn_sink=None if attn_sink is None else attn_sink.cuda(), backend=backend, return_lse=True,
        )
        ref, ref_lse, _ = sparse_attention_reference(
            torch.cat([q_nope, q_pe], -1).double(), kv.double(), indices, 0.07, topk_length=topk_length,
            attn_sink=None if attn_sink is None else attn_sink.double(), bad_is_error=False,
        )
        assert _rel(out, ref) < BOUND
        lse = lse.cpu().double()
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=2e-3, atol=2e-2)


# --------------------------------------------------------------------------- FLASHMLA dense decode


def _flashmla_dense_reasons(heads, q_len):
    config = registry.decode_config(MLADims.deepseek_v3(num_heads=heads), torch.bfloat16, torch.bfloat16, 64, q_len)
    return registry.default_registry.reasons("decode", "FLASHMLA", current_platform(), config)


@pytest.mark.parametrize("heads,q_len", [(16, 1), (128, 1), (128, 2)])
def test_flashmla_dense_decode_matches_reference(heads, q_len):
    reasons = _flashmla_dense_reasons(heads, q_len)
    if reasons:
        pytest.skip(f"FLASHMLA cannot run this case here: {reasons[0]}")
    generator = torch.Generator().manual_seed(heads + q_len)
    seq_lens = torch.tensor([0, 1, 700, 64, 3000] if q_len == 1 else [2, 3, 701, 65, 3001], dtype=torch.int32)
    batch = len(seq_lens)
    blocks = -(-int(seq_lens.max()) // 64)
    cache = torch.randn(batch * blocks + 3, 64, 576, generator=generator).to(torch.bfloat16).cuda()
    table = torch.randperm(batch * blocks + 3, generator=generator)[: batch * blocks].view(batch, blocks).to(torch.int32).cuda()
    shape = (batch, heads) if q_len == 1 else (batch, q_len, heads)
    q_nope = torch.randn(*shape, LKV, generator=generator).to(torch.bfloat16).cuda()
    q_pe = torch.randn(*shape, ROPE, generator=generator).to(torch.bfloat16).cuda()
    lens = seq_lens.cuda()
    out, lse = mm.ops.mla_decode(q_nope, q_pe, cache, table, lens, 0.07, backend="FLASHMLA", return_lse=True)
    ref, ref_lse = mm.ops.mla_decode(q_nope.double().cpu(), q_pe.double().cpu(), cache.double().cpu(), table.cpu(),
                                     seq_lens, 0.07, backend="REFERENCE", return_lse=True)
    assert _rel(out, ref) < BOUND
    lse = lse.cpu().double()
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    if q_len == 1:  # an empty request: 0 and -inf
        assert bool((out[0] == 0).all()) and bool((lse[0] == -math.inf).all())
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite].double(), rtol=2e-3, atol=2e-2)


def test_flashmla_dense_decode_plan_replays_from_a_cuda_graph_after_replanning():
    reasons = _flashmla_dense_reasons(128, 1)
    if reasons:
        pytest.skip(f"FLASHMLA cannot run this case here: {reasons[0]}")
    from mla_multi.backends.flashmla import FlashMLADecodeImpl

    generator = torch.Generator().manual_seed(3)
    batch, heads, blocks = 4, 128, 40
    impl = FlashMLADecodeImpl(heads, 0.07, LKV, ROPE, torch.bfloat16, 64, torch.device("cuda"))
    cache = torch.randn(batch * blocks, 64, 576, generator=generator).to(torch.bfloat16).cuda()
    table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks).cuda()
    lens = torch.tensor([100, 2000, 64, 2559], dtype=torch.int32)
    static_lens = lens.cuda()
    q_nope = torch.randn(batch, heads, LKV, generator=generator).to(torch.bfloat16).cuda()
    q_pe = torch.randn(batch, heads, ROPE, generator=generator).to(torch.bfloat16).cuda()
    plan = impl.plan(lens, table, cuda_graph=True, slot=991)
    result = {}

    def step():
        result["out"] = impl.forward_mqa(q_nope, q_pe, cache, table, static_lens, plan=plan)[0]

    graph = capture_graph(step)
    for new in ([2500, 1, 640, 0], [64, 64, 64, 64]):
        new_lens = torch.tensor(new, dtype=torch.int32)
        plan = impl.plan(new_lens, table, cuda_graph=True, slot=991)  # the same buffers
        static_lens.copy_(new_lens)
        graph.replay()
        torch.cuda.synchronize()
        ref = mm.ops.mla_decode(q_nope.double().cpu(), q_pe.double().cpu(), cache.double().cpu(), table.cpu(),
                                new_lens, 0.07, backend="REFERENCE")
        assert _rel(result["out"], ref) < BOUND


def _sm90_in_place():
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason

    reason = ds_mla_decode_reason(current_platform())
    if reason:
        pytest.skip(reason)


def test_triton_fp8_ds_mla_decode_reads_the_cache_in_place_on_sm90(monkeypatch):
    """No scratch on sm_90: the warp-specialised loader dequantises the named rows itself (the scratch
    path is made to fail), and the result matches float64 as the scratch path's does."""
    _sm90_in_place()
    from mla_multi.kernels import sparse_indices

    def no_scratch(*args, **kwargs):
        raise AssertionError("the fp8_ds_mla rows went through the dequantised scratch")

    generator = torch.Generator().manual_seed(21)
    cache, rows, _ = _cache("fp8_ds_mla", 64, 64, generator, poison_slots=range(4000, 4096))
    tokens, heads, topk = 5, 128, 1024
    indices = _indices(generator, tokens, topk, list(range(4000))).cuda()
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16)
    ref, ref_lse, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1).double(), rows, indices.cpu(), 0.07)
    with monkeypatch.context() as patch:
        patch.setattr(sparse_indices, "dequantize_named_rows", no_scratch)
        out, lse = mm.ops.mla_sparse_decode(q_nope.cuda(), q_pe.cuda(), cache, indices, 0.07, backend="TRITON",
                                            return_lse=True)
    assert _rel(out, ref) < BOUND
    torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=2e-3, atol=1e-2)
    # a float16 query keeps the scratch path (the loader writes bfloat16 stages)
    with monkeypatch.context() as patch:
        patch.setattr(sparse_indices, "dequantize_named_rows", no_scratch)
        with pytest.raises(AssertionError, match="scratch"):
            mm.ops.mla_sparse_decode(q_nope.half().cuda(), q_pe.half().cuda(), cache, indices, 0.07, backend="TRITON")


@pytest.mark.parametrize("heads", [64, 128])
def test_triton_fp8_ds_mla_decode_reads_every_e4m3_byte_as_the_format_does(heads):
    """Each token's 512 latent bytes run through every e4m3 number (a different rotation a token), its four
    scales powers of two from 2^-20 to 2^20, and each token attends to one row alone: the output row is the
    format's dequantisation exactly (bfloat16 values, weight 1), for the loader's conversion of every byte."""
    from mla_multi import cache_formats as cf

    if current_platform().is_cuda() and not current_platform().has_device_capability(8, 9):
        pytest.skip("fp8_ds_mla needs sm_89+ (Triton's float8_e4m3fn conversion)")
    fmt = cf.get_format("fp8_ds_mla")
    generator = torch.Generator().manual_seed(heads)
    tokens = 64
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    records = torch.zeros(tokens, fmt.bytes_per_token, dtype=torch.uint8)
    records[:, :LKV] = codes[(torch.arange(LKV) + 37 * torch.arange(tokens)[:, None]) % codes.numel()]
    scales = torch.exp2(torch.randint(-20, 21, (tokens, 4), generator=generator).float())
    records[:, LKV:LKV + 16] = scales.view(torch.uint8).reshape(tokens, 16)
    records[:, LKV + 16:] = torch.randn(tokens, ROPE, generator=generator).to(torch.bfloat16).view(
        torch.uint8).reshape(tokens, 2 * ROPE)
    cache = fmt.allocate(1, tokens, "cuda", fill=0xFF)
    fmt.write_records(cache, torch.arange(tokens, device="cuda"), records.cuda())
    order = torch.randperm(tokens, generator=generator)
    indices = torch.full((tokens, 64), -1, dtype=torch.int32)
    indices[:, 0] = order
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16).cuda()
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16).cuda()
    out = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices.cuda(), 0.07, backend="TRITON")
    want = fmt.dequantize(records, torch.float64)[order, :LKV]
    assert torch.equal(out.double().cpu(), want[:, None, :].expand(tokens, heads, LKV))


@pytest.mark.parametrize("tokens,heads,topk", [(1, 128, 2048), (6, 128, 512), (3, 16, 320)])
def test_triton_fp8_ds_mla_decode_reads_the_index_lists_as_they_are_on_sm90(monkeypatch, tokens, heads, topk):
    """Without topk_length, sm_90's in-place decode takes each token's index list as its block-table row: no
    compaction launch (made to fail), -1 entries masked in the kernel and never read (slot 0, which -1 would
    name if clamped, holds NaN), duplicates counted twice, a token with no valid index 0 and -inf; one token
    splits its list over several programs."""
    _sm90_in_place()
    from mla_multi.kernels import sparse_indices

    def no_compaction(*args, **kwargs):
        raise AssertionError("the index lists were compacted")

    generator = torch.Generator().manual_seed(tokens * 31 + topk)
    cache, rows, _ = _cache("fp8_ds_mla", 64, 64, generator, poison_slots=[0] + list(range(4000, 4096)))
    indices = _indices(generator, tokens, topk, list(range(1, 4000)), minus_one=0.3)
    indices[0, 5:9] = indices[0, 4]  # duplicates
    if tokens > 1:
        indices[-1] = -1  # no valid index
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16)
    ref, ref_lse, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1).double(), rows, indices, 0.07)
    from mla_multi import ops

    monkeypatch.setattr(ops, "_PLANS", {})  # the op binds its launches afresh (no plan of an earlier test)
    with monkeypatch.context() as patch:
        patch.setattr(sparse_indices, "compact_indices", no_compaction)
        patch.setattr(sparse_indices, "IndexCompaction", no_compaction)  # the op's bound launch compacts by it
        out, lse = mm.ops.mla_sparse_decode(q_nope.cuda(), q_pe.cuda(), cache, indices.cuda(), 0.07, backend="TRITON",
                                            return_lse=True)
    live = slice(0, tokens - 1) if tokens > 1 else slice(0, 1)
    assert _rel(out[live], ref[live]) < BOUND
    torch.testing.assert_close(lse[live].cpu().double(), ref_lse[live], rtol=2e-3, atol=1e-2)
    if tokens > 1:
        assert bool((out[-1] == 0).all()) and bool(torch.isneginf(lse[-1]).all())
    # with topk_length the lists are still compacted (the kernel reads only each token's valid count)
    with monkeypatch.context() as patch:
        patch.setattr(sparse_indices, "compact_indices", no_compaction)
        patch.setattr(sparse_indices, "IndexCompaction", no_compaction)  # the op's bound launch compacts by it
        with pytest.raises(AssertionError, match="compacted"):
            mm.ops.mla_sparse_decode(q_nope.cuda(), q_pe.cuda(), cache, indices.cuda(), 0.07, backend="TRITON",
                                     topk_length=torch.full((tokens,), topk, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("masked", [True, False], ids=["lists-as-they-are", "compacted"])
def test_triton_fp8_ds_mla_repeated_eager_calls_reuse_their_launch_on_sm90(masked):
    """An eager call of a layout seen before only allocates and launches (the dense impl keeps the split
    count and the bound kernels of the layout): three calls with new queries and indices, each against
    float64, one kept launch plan, a partial buffer of the shared workspace each time."""
    _sm90_in_place()
    from mla_multi import ops

    generator = torch.Generator().manual_seed(7 + masked)
    cache, rows, _ = _cache("fp8_ds_mla", 64, 64, generator, poison_slots=list(range(4000, 4096)))
    tokens, heads, topk = 4, 128, 512
    for call in range(3):
        indices = _indices(generator, tokens, topk, list(range(4000)), minus_one=0.2)
        q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(torch.bfloat16)
        q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(torch.bfloat16)
        lengths = None if masked else torch.full((tokens,), topk - 3 * call, dtype=torch.int32)
        ref, ref_lse, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1).double(), rows, indices, 0.07,
                                                     topk_length=lengths)
        out, lse = mm.ops.mla_sparse_decode(q_nope.cuda(), q_pe.cuda(), cache, indices.cuda(), 0.07, backend="TRITON",
                                            topk_length=None if lengths is None else lengths.cuda(), return_lse=True)
        assert _rel(out, ref) < BOUND, call
        torch.testing.assert_close(lse.cpu().double(), ref_lse, rtol=2e-3, atol=1e-2)
    plans = [plan for key, plan in ops._PLANS.items() if key[0] == "mla_sparse_decode" and plan.impl.__class__.__name__ == "TritonSparseDecodeImpl"
             and plan.tokens == tokens and plan.topk == topk and plan.heads == heads]
    assert len(plans[-1].impl._launches) == 1  # one dense launch bound, every later call only launches
    launch = plans[-1].launch  # the op's launch bound to the layout (`TritonSparseDecodeImpl.bind`)
    assert type(launch).__name__ == "_SparseInPlaceLaunch" and launch.masked == masked


@pytest.mark.parametrize("heads,splits", [(16, 1), (16, 4), (128, 1), (128, 3)])
def test_dense_paged_fp8_ds_mla_decode_matches_float64(heads, splits):
    """The kernel-level decode over a paged fp8_ds_mla cache (pages of 64: one block-table entry a tile,
    partial last tiles, split and direct), unread pages poisoned, against float64 on the dequantised rows."""
    _sm90_in_place()
    from mla_multi.backends.reference import mla_decode_reference
    from mla_multi.kernels.mla_decode import attn_logits_width, mla_decode_fwd

    generator = torch.Generator().manual_seed(heads + splits)
    num_blocks, block_size = 40, 64
    cache, rows, _ = _cache("fp8_ds_mla", num_blocks, block_size, generator, poison_slots=range(36 * 64, 40 * 64))
    seq_lens = torch.tensor([1, 200, 0, 64 * 9 - 5], dtype=torch.int32)
    block_table = torch.randperm(36, generator=generator)[:36].view(4, 9).to(torch.int32)
    batch = seq_lens.numel()
    q_nope = torch.randn(batch, heads, LKV, generator=generator).to(torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE, generator=generator).to(torch.bfloat16)
    out = torch.full((batch, heads, LKV), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((batch, heads), float("nan"), dtype=torch.float32, device="cuda")
    attn_logits = torch.full((batch, heads, splits, attn_logits_width(LKV)), float("nan"), device="cuda")
    mla_decode_fwd(q_nope.cuda(), q_pe.cuda(), cache, block_table.cuda(), seq_lens.cuda(), 0.05, k_scale=None,
                   num_kv_splits=splits, attn_logits=attn_logits, out=out, lse=lse)
    ref, ref_lse = mla_decode_reference(
        q_nope.double(), q_pe.double(), rows.view(num_blocks, block_size, 576), block_table, seq_lens, 0.05,
    )
    assert bool((out[2] == 0).all()) and bool((lse[2] == -math.inf).all())
    live = [0, 1, 3]
    assert _rel(out[live], ref[live]) < BOUND
    torch.testing.assert_close(lse[live].cpu().double(), ref_lse[live].double(), rtol=2e-3, atol=1e-2)


def test_flashmla_fp8_ds_mla_decode_later_eager_calls_reuse_the_first_calls_buffers(monkeypatch):
    """A bound FLASHMLA sparse decode (`bind`) called four times eagerly, new queries and lists each time
    against float64: the later calls launch into the first call's kept buffers by their addresses; the third
    passes another cache tensor and a bad index in token 2, whose rows and LSE become NaN, the flag set; the
    fourth does so again under a Triton launch hook (a profiler's), which takes the kept tensors instead."""
    from triton import knobs

    from mla_multi.backends.flashmla import FlashMLASparseDecodeImpl

    _need("sparse_decode", "FLASHMLA", 128, torch.uint8, 128)
    generator = torch.Generator().manual_seed(78)
    cache, rows, _ = _cache("fp8_ds_mla", 8, 64, generator)
    tokens, heads, topk = 4, 128, 128

    def inputs():
        q = torch.randn(tokens, heads, LKV + ROPE, generator=generator).to(torch.bfloat16).cuda()
        return q[..., :LKV], q[..., LKV:], _indices(generator, tokens, topk, list(range(512))).cuda()

    q_nope, q_pe, indices = inputs()
    launch = FlashMLASparseDecodeImpl(heads, LKV, ROPE, q_nope.device).bind(q_nope, q_pe, cache, indices)
    errors.error_flag(q_nope.device).zero_()
    for call in range(4):
        if call:
            q_nope, q_pe, indices = inputs()
        if call >= 2:
            cache = cache.clone()
            indices[2, 9] = 512  # past the cache
        if call == 3:
            assert isinstance(launch.call.index_plan.eager_kept()[0], int)
            monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
            assert isinstance(launch.call.index_plan.eager_kept()[0], torch.Tensor)
        out, lse = launch(q_nope, q_pe, cache, indices, 0.06)
        torch.cuda.synchronize()
        assert launch.eager is not None
        good = [0, 1, 3] if call >= 2 else [0, 1, 2, 3]
        ref, ref_lse, _ = sparse_attention_reference(torch.cat([q_nope, q_pe], -1)[good].double().cpu(), rows,
                                                     indices[good].cpu(), 0.06)
        assert _rel(out[good], ref) < BOUND
        assert bool(errors.error_flag(q_nope.device).item() & errors.SPARSE_INDEX) == (call >= 2)
        errors.error_flag(q_nope.device).zero_()
        if call >= 2:
            assert bool(out[2].isnan().all()) and bool(lse[2].isnan().all())


def test_a_sparse_layer_over_an_fp8_ds_mla_cache_replays_from_a_cuda_graph(monkeypatch):
    """V3.2's sparse layer over its 656-byte cache, whose writer is one launch without a host synchronisation
    (`concat_and_cache_quantized`; it selected the kept tokens on the host before, so such a step could not be
    captured): a decode step captured, replayed with new queries, rows and top-k positions in the captured
    tensors, gives the eager forward's output on a copy of the cache taken before the replay, and writes the
    new tokens' records as the eager step does."""
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")  # the data checks read indices on the host
    heads, batch, block = 16, 4, 64
    dims = mm.MLADims.deepseek_v3(num_heads=heads)
    generator = torch.Generator().manual_seed(21)
    weight = (torch.randn(heads * 256, LKV, generator=generator) / LKV**0.5).to(torch.bfloat16).cuda()
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=block, max_model_len=1024,
                            max_num_seqs=batch, kv_cache_dtype="fp8_ds_mla", sparse_topk=64)
    cache = layer.allocate_kv_cache(batch * 16)
    rows = torch.randn(batch * 16 * block, LKV + ROPE, generator=generator).to(torch.bfloat16).cuda()
    mm.ops.concat_and_cache_mla(rows[:, :LKV], rows[:, LKV:], cache, torch.arange(rows.shape[0], device="cuda"))
    table = torch.arange(batch * 16, device="cuda", dtype=torch.int32).view(batch, 16)
    seq_lens = [300, 1000, 64, 700]
    md = mm.CommonAttentionMetadata.from_lengths([1] * batch, seq_lens, table, block)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        positions = torch.stack([torch.randint(-1, n, (64,), generator=g) for n in seq_lens]).to(torch.int32)
        return (torch.randn(batch, heads, dims.qk_head_dim, generator=g).to(torch.bfloat16).cuda(),
                torch.randn(batch, LKV, generator=g).to(torch.bfloat16).cuda(),
                torch.randn(batch, ROPE, generator=g).to(torch.bfloat16).cuda(), positions.cuda())

    static = inputs(1)
    out = torch.empty(batch, heads * dims.v_head_dim, device="cuda", dtype=torch.bfloat16)
    layer.plan(md, cuda_graph=True)

    def step():
        layer.forward(static[0], static[1], static[2], cache, md, output=out, topk_indices=static[3])

    graph = capture_graph(step)
    fresh = inputs(2)
    for tensor, value in zip(static, fresh):
        tensor.copy_(value)
    before = cache.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expected = layer.forward(fresh[0], fresh[1], fresh[2], before, md, topk_indices=fresh[3])
    assert _rel(out, expected) < 1e-3
    assert torch.equal(cache, before)  # the replay wrote the new tokens' records the eager step wrote
