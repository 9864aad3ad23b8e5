"""Sparse MLA (DeepSeek Sparse Attention): the fp8_ds_mla cache layout, mm.ops.mla_sparse_decode /
mla_sparse_prefill against float64 loops, index semantics, bad input and the sparse phases of the registry."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import errors, registry
from mla_multi.backends.reference import ReferenceSparseDecodeImpl
from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from mla_multi.platforms import SPECS, override

LKV, ROPE = 512, 64


def naive_sparse(q_nope, q_pe, rows, indices, scale, topk_length=None, attn_sink=None, none=lambda i, n: i < 0 or i >= n):
    """float64 loops: out [T, N, 512], lse [T, N] over the rows each token's indices name."""
    tokens, heads = q_nope.shape[0], q_nope.shape[1]
    out = torch.zeros(tokens, heads, LKV, dtype=torch.float64)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float64)
    rows = rows.double()
    for t in range(tokens):
        count = indices.shape[1] if topk_length is None else int(topk_length[t])
        chosen = [int(i) for i in indices[t, :count].tolist() if not none(int(i), rows.shape[0])]
        if not chosen:
            continue
        keys = rows[chosen]
        for h in range(heads):
            query = torch.cat([q_nope[t, h], q_pe[t, h]]).double()
            logits = scale * keys @ query
            lse[t, h] = torch.logsumexp(logits, 0)
            out[t, h] = torch.softmax(logits, 0) @ keys[:, :LKV]
            if attn_sink is not None:
                out[t, h] *= 1.0 / (1.0 + math.exp(float(attn_sink[h]) - float(lse[t, h]))) if math.isfinite(
                    float(attn_sink[h]) - float(lse[t, h])) else (0.0 if float(attn_sink[h]) == math.inf else 1.0)
    return out, lse


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def random_indices(generator, tokens, topk, num_slots, minus_one=0.2):
    idx = torch.randint(0, num_slots, (tokens, topk), generator=generator, dtype=torch.int32)
    idx[torch.rand(tokens, topk, generator=generator) < minus_one] = -1
    return idx


# --------------------------------------------------------------------------- the cache layout


def test_fp8_ds_mla_layout_bytes_and_round_trip():
    generator = torch.Generator().manual_seed(0)
    kv_c = torch.randn(7, LKV, generator=generator) * torch.logspace(-3, 2, LKV)
    kv_c[3] = 0.0  # an all-zero token keeps a positive scale
    k_pe = torch.randn(7, ROPE, generator=generator)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    assert rows.shape == (7, FP8_DS_MLA_BYTES) and rows.dtype == torch.uint8
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    expected = (kv_c.view(7, 4, 128).abs().amax(-1) / 448).clamp_min(torch.finfo(torch.float32).tiny)
    assert torch.equal(scales, expected)
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k_pe.to(torch.bfloat16))
    back = dequantize_fp8_ds_mla(rows, torch.float64)
    assert back.shape == (7, 576)
    error = (back[:, :LKV] - kv_c.double()).abs().view(7, 4, 128)
    bound = 2.0**-4 * kv_c.double().abs().view(7, 4, 128) + scales.double().unsqueeze(-1) * 2.0**-9
    assert bool((error <= bound).all())
    assert torch.equal(back[3, :LKV], torch.zeros(LKV, dtype=torch.float64))
    with pytest.raises(ValueError, match="656"):
        dequantize_fp8_ds_mla(torch.zeros(2, 600, dtype=torch.uint8))


def test_concat_and_cache_writes_the_fp8_ds_mla_layout_at_the_slots():
    generator = torch.Generator().manual_seed(1)
    cache = torch.full((4, 16, FP8_DS_MLA_BYTES), 0xAB, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(5, LKV, generator=generator), torch.randn(5, ROPE, generator=generator)
    slots = torch.tensor([3, -1, 17, 63, 40])
    mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    flat = cache.view(64, FP8_DS_MLA_BYTES)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], rows[token])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(64) if s not in written]
    assert bool((flat[untouched] == 0xAB).all())  # the skipped token and every other slot unchanged
    with pytest.raises(ValueError, match="slot_mapping"):
        mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([0, 1, 2, 3, 64]))
    with pytest.raises(ValueError, match="656"):
        mm.ops.concat_and_cache_mla(kv_c, k_pe, torch.zeros(4, 16, 600, dtype=torch.uint8), slots)
    with pytest.raises(ValueError, match="tile scales come from the data"):
        mm.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale=0.5)


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparse_decode_matches_float64(block_size, dtype):
    generator = torch.Generator().manual_seed(block_size)
    heads, tokens, topk = 4, 5, 96
    num_blocks = 256 // block_size
    cache = torch.randn(num_blocks, block_size, 576, generator=generator).to(dtype)
    q_nope = torch.randn(tokens, heads, LKV, generator=generator).to(dtype)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator).to(dtype)
    indices = random_indices(generator, tokens, topk, 256)
    indices[1, :] = -1  # no valid index: 0 and -inf
    indices[2, 5:9] = indices[2, 0]  # duplicates count
    lengths = torch.tensor([96, 96, 40, 0, 64], dtype=torch.int32)
    sink = torch.tensor([0.5, -math.inf, math.inf, -2.0])
    for topk_length, attn_sink in ((None, None), (lengths, None), (None, sink), (lengths, sink)):
        out, lse = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.04, topk_length=topk_length,
                                            attn_sink=attn_sink, return_lse=True)
        ref, ref_lse = naive_sparse(q_nope, q_pe, cache.view(-1, 576), indices, 0.04, topk_length, attn_sink)
        assert out.dtype == dtype and lse.dtype == torch.float32
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert rel(out, ref) < tol
        assert torch.equal(lse[1], torch.full((heads,), -math.inf))
        assert torch.all(out[1] == 0)
        finite = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isfinite(lse), finite)


def test_sparse_decode_with_several_query_tokens_and_fp8_caches():
    generator = torch.Generator().manual_seed(9)
    batch, q_len, heads, topk = 3, 2, 2, 64
    kv_c, k_pe = torch.randn(128, LKV, generator=generator), torch.randn(128, ROPE, generator=generator)
    ds_cache = quantize_fp8_ds_mla(kv_c, k_pe).view(2, 64, FP8_DS_MLA_BYTES)
    q_nope = torch.randn(batch, q_len, heads, LKV, generator=generator)
    q_pe = torch.randn(batch, q_len, heads, ROPE, generator=generator)
    indices = random_indices(generator, batch * q_len, topk, 128).view(batch, q_len, topk)
    lengths = torch.tensor([64, 10, 33], dtype=torch.int32)  # per request, for each of its tokens
    out = mm.ops.mla_sparse_decode(q_nope, q_pe, ds_cache, indices, 0.05, topk_length=lengths)
    assert out.shape == (batch, q_len, heads, LKV)
    rows = dequantize_fp8_ds_mla(ds_cache.view(-1, FP8_DS_MLA_BYTES), torch.float64)
    ref, _ = naive_sparse(q_nope.view(-1, heads, LKV), q_pe.view(-1, heads, ROPE), rows, indices.view(-1, topk), 0.05,
                          lengths.repeat_interleave(q_len))
    assert rel(out.view(-1, heads, LKV), ref) < 1e-5
    # against the unquantised rows: the layout's error (stated bound 6e-2, the FP8 KV bound)
    exact, _ = naive_sparse(q_nope.view(-1, heads, LKV), q_pe.view(-1, heads, ROPE), torch.cat([kv_c, k_pe], -1),
                            indices.view(-1, topk), 0.05, lengths.repeat_interleave(q_len))
    assert rel(out.view(-1, heads, LKV), exact) < 6e-2
    # a per-tensor FP8 cache with k_scale
    fp8 = (torch.cat([kv_c, k_pe], -1) / 0.05).to(torch.float8_e4m3fn).view(2, 64, 576)
    out8 = mm.ops.mla_sparse_decode(q_nope, q_pe, fp8, indices, 0.05, k_scale=0.05)
    ref8, _ = naive_sparse(q_nope.view(-1, heads, LKV), q_pe.view(-1, heads, ROPE), fp8.view(-1, 576).double() * 0.05,
                           indices.view(-1, topk), 0.05)
    assert rel(out8.view(-1, heads, LKV), ref8) < 1e-5


def test_sparse_decode_bad_indices():
    generator = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 8, 576, generator=generator)
    q_nope, q_pe = torch.randn(3, 2, LKV, generator=generator), torch.randn(3, 2, ROPE, generator=generator)
    indices = torch.tensor([[0, 1, -1], [16, 2, 3], [-2, 4, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"indices hold \[16, -2\]"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices, 0.1)
    # without the checks (as on a GPU): NaN rows for the bad tokens, the others exact, the flag set
    errors.error_flag("cpu").zero_()
    out, lse = ReferenceSparseDecodeImpl(2, LKV, ROPE).forward(q_nope, q_pe, cache, indices, 0.1)
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all() and torch.isnan(lse[1:]).all()
    ref, _ = naive_sparse(q_nope[:1], q_pe[:1], cache.view(-1, 576), indices[:1], 0.1)
    assert rel(out[:1], ref) < 1e-5
    with pytest.raises(ValueError, match="sparse decode index"):
        mm.ops.raise_pending_errors("cpu")
    with pytest.raises(ValueError, match="topk_length"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, cache, indices.clamp(0, 15), 0.1,
                                 topk_length=torch.tensor([1, 4, 0], dtype=torch.int32))


def test_sparse_decode_bad_layouts():
    q_nope, q_pe = torch.randn(2, 2, LKV), torch.randn(2, 2, ROPE)
    idx = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, torch.zeros(2, 8, 600, dtype=torch.uint8), idx, 0.1)
    with pytest.raises(ValueError, match="k_scale"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, torch.zeros(2, 8, 576).to(torch.float8_e4m3fn), idx, 0.1)
    with pytest.raises(ValueError, match="indices"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, torch.zeros(2, 8, 576), idx.long(), 0.1)
    with pytest.raises(ValueError, match="attn_sink"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, torch.zeros(2, 8, 576), idx, 0.1, attn_sink=torch.zeros(3))


# --------------------------------------------------------------------------- prefill


def test_sparse_prefill_matches_float64_and_treats_out_of_range_as_none():
    generator = torch.Generator().manual_seed(4)
    tokens, heads, topk, rows = 6, 3, 80, 50
    kv = torch.randn(rows, 576, generator=generator, dtype=torch.float64)
    q_nope = torch.randn(tokens, heads, LKV, generator=generator, dtype=torch.float64)
    q_pe = torch.randn(tokens, heads, ROPE, generator=generator, dtype=torch.float64)
    indices = torch.randint(-1, rows + 20, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[4] = rows  # only out-of-range entries: no token
    lengths = torch.tensor([80, 3, 0, 79, 80, 41], dtype=torch.int32)
    sink = torch.tensor([1.0, -math.inf, -0.5], dtype=torch.float32)
    out, lse = mm.ops.mla_sparse_prefill(q_nope, q_pe, kv, indices, 0.03, topk_length=lengths, attn_sink=sink,
                                         return_lse=True)
    ref, ref_lse = naive_sparse(q_nope, q_pe, kv, indices, 0.03, lengths, sink)
    assert rel(out, ref) < 1e-12
    assert torch.all(out[4] == 0) and torch.equal(lse[4], torch.full((heads,), -math.inf))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- registry


def test_sparse_phases_select_with_reasons_and_strict_overrides(monkeypatch):
    dims = mm.MLADims.deepseek_v3(num_heads=128)
    # without aiter or FlashMLA installed: TRITON on GPUs
    expected = {"MI300X": ("TRITON", "TRITON"), "MI355X": ("TRITON", "TRITON"), "H200": ("TRITON", "TRITON"),
                "CPU": ("REFERENCE", "REFERENCE")}
    for device, names in expected.items():
        with override(device):
            for name, (phase, kv) in zip(names, (("sparse_decode", torch.uint8), ("sparse_prefill", torch.bfloat16))):
                assert registry.select_sparse_backend(phase, dims, torch.bfloat16, kv, 2048).name == name, device
    monkeypatch.setenv("MLA_MULTI_SPARSE_DECODE_BACKEND", "nonsense")
    with pytest.raises(mm.UnknownBackendError, match="REFERENCE"):
        registry.select_sparse_backend("sparse_decode", dims, torch.bfloat16, torch.uint8, 2048)
    monkeypatch.setenv("MLA_MULTI_SPARSE_DECODE_BACKEND", "reference")
    assert registry.select_sparse_backend("sparse_decode", dims, torch.bfloat16, torch.uint8, 2048).name == "REFERENCE"
    monkeypatch.delenv("MLA_MULTI_SPARSE_DECODE_BACKEND")
    # a forced backend that cannot run the configuration raises with its reasons
    with pytest.raises(mm.NoBackendError, match="kv dtype"):
        registry.select_sparse_backend("sparse_prefill", dims, torch.bfloat16, torch.uint8, 2048, backend="REFERENCE")


# --------------------------------------------------------------------------- torch.library / torch.compile


def _sparse_cases():
    generator = torch.Generator().manual_seed(21)
    q_nope, q_pe = torch.randn(4, 2, LKV, generator=generator), torch.randn(4, 2, ROPE, generator=generator)
    ds = quantize_fp8_ds_mla(torch.randn(32, LKV, generator=generator),
                             torch.randn(32, ROPE, generator=generator)).view(2, 16, FP8_DS_MLA_BYTES)
    idx = random_indices(generator, 4, 64, 32)
    sink = torch.tensor([0.3, -1.0])
    lengths = torch.tensor([64, 3, 0, 50], dtype=torch.int32)
    return [
        ("mla_sparse_decode", (q_nope, q_pe, ds, idx, 0.05), dict(return_lse=True, topk_length=lengths)),
        ("mla_sparse_decode", (q_nope, q_pe, torch.randn(2, 16, 576, generator=generator), idx, 0.05),
         dict(attn_sink=sink)),
        ("mla_sparse_prefill", (q_nope, q_pe, torch.randn(40, 576, generator=generator), idx, 0.05),
         dict(return_lse=True, attn_sink=sink, topk_length=lengths)),
    ]


@pytest.mark.parametrize("index", range(3))
def test_sparse_ops_pass_opcheck(index):
    name, args, kwargs = _sparse_cases()[index]
    torch.library.opcheck(getattr(torch.ops.mla_multi, name).default, args, kwargs,
                          test_utils=["test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_static", "test_aot_dispatch_dynamic"])


def test_compiled_sparse_decode_matches_eager():
    torch._dynamo.reset()
    name, args, kwargs = _sparse_cases()[0]
    linear = torch.nn.Linear(LKV, 8)

    def step(q_nope, q_pe, cache, idx, lengths):
        out, lse = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, idx, 0.05, topk_length=lengths, return_lse=True)
        return linear(out), lse

    with torch.inference_mode():
        eager = step(*args[:4], kwargs["topk_length"])
        compiled = torch.compile(step, fullgraph=True)(*args[:4], kwargs["topk_length"])
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled[1], eager[1])
    torch._dynamo.reset()


# --------------------------------------------------------------------------- MLAAttention in sparse mode


@pytest.mark.parametrize("kv_cache_dtype,bound", [("auto", 1e-5), ("fp8_ds_mla", 6e-2)])
def test_sparse_layer_matches_float64_over_mixed_steps(kv_cache_dtype, bound):
    from mla_multi.testing import PagedScenario, relative_error

    dims = mm.MLADims.deepseek_v3(num_heads=4)
    generator = torch.Generator().manual_seed(5)
    weight = (torch.randn(4 * 256, 512, generator=generator, dtype=torch.float64) / 512**0.5).float()
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=512, max_num_seqs=8,
                            sparse_topk=64, kv_cache_dtype=kv_cache_dtype)
    assert layer.backends() == {"sparse_decode": "REFERENCE"}
    scenario = PagedScenario(dims, 16, 64, torch.device("cpu"), torch.float32, seed=2)
    ds = kv_cache_dtype == "fp8_ds_mla"
    cache = torch.full((64, 16, 656 if ds else 576), 0 if ds else float("nan"), dtype=torch.uint8 if ds else torch.float32)
    for requests in ([(0, 40), (1, 20)], [(0, 1), (1, 1), (2, 30)], [(2, 1), (0, 1), (1, 9)]):
        metadata, q, kv_c, k_pe = scenario.step(requests)
        positions = scenario.topk_positions(requests, 48)
        positions[0, :5] = positions[0, 0]  # duplicates count twice
        layer.plan(metadata)
        out = layer.forward(q, kv_c, k_pe, cache, metadata, topk_indices=positions)
        expected = scenario.sparse_reference(requests, q, layer.scale, weight, positions)
        assert relative_error(out, expected) < bound


def test_sparse_layer_bad_input():
    dims = mm.MLADims.deepseek_v3(num_heads=2)
    weight = torch.randn(2 * 256, 512)
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        mm.MLAAttention(dims, 0.1, weight, block_size=16, max_model_len=64, max_num_seqs=2, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ValueError, match="sparse_topk"):
        mm.MLAAttention(dims, 0.1, weight, block_size=16, max_model_len=64, max_num_seqs=2, sparse_topk=0)
    layer = mm.MLAAttention(dims, 0.1, weight, block_size=16, max_model_len=64, max_num_seqs=2, sparse_topk=8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    metadata = mm.CommonAttentionMetadata.from_lengths([1, 3], [10, 20], table, 16)
    cache = torch.zeros(4, 16, 576)
    q, kv_c, k_pe = torch.randn(4, 2, 192), torch.randn(4, 512), torch.randn(4, 64)
    with pytest.raises(ValueError, match="needs topk_indices"):
        layer.forward(q, kv_c, k_pe, cache, metadata)
    with pytest.raises(ValueError, match="at most sparse_topk=8"):
        layer.forward(q, kv_c, k_pe, cache, metadata, topk_indices=torch.zeros(4, 9, dtype=torch.int32))
    positions = torch.zeros(4, 8, dtype=torch.int32)
    positions[0, 3] = 10  # request 0 holds 10 tokens: positions 0..9
    with pytest.raises(ValueError, match=r"positions \[10\] outside their requests"):
        layer.forward(q, kv_c, k_pe, cache, metadata, topk_indices=positions)
    dense = mm.MLAAttention(dims, 0.1, weight, block_size=16, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="dense MLAAttention"):
        dense.forward(q, kv_c, k_pe, cache, metadata, topk_indices=positions)


def test_triton_sparse_decode_reasons_per_platform():
    from mla_multi.backends.triton import TritonSparseDecodeBackend

    dims = mm.MLADims.deepseek_v3(num_heads=128)

    def reasons(device, kv):
        with override(device):
            config = registry.sparse_config(dims, torch.bfloat16, kv, 2048)
            return TritonSparseDecodeBackend.validate_configuration(mm.current_platform(), config)

    assert reasons("H100", torch.uint8) == [] and reasons("MI355X", torch.uint8) == []
    assert reasons("H200", torch.bfloat16) == [] and reasons("MI300X", torch.float8_e4m3fnuz) == []
    assert any("sm_89" in r for r in reasons("A100", torch.uint8))
    assert reasons("MI300X", torch.uint8) == []  # fp8_ds_mla through the row dequantisation, on gfx942 too
    assert any("e4m3fnuz" in r for r in reasons("H100", torch.float8_e4m3fnuz))
    too_many_heads = registry.sparse_config(mm.MLADims.deepseek_v3(num_heads=256), torch.bfloat16, torch.bfloat16, 64)
    assert any("over the maximum" in r for r in TritonSparseDecodeBackend.validate_configuration(SPECS["H100"],
                                                                                             too_many_heads))
    # ranked before REFERENCE on GPUs (measured); REFERENCE still when forced
    with override("H100"):
        assert registry.select_sparse_backend("sparse_decode", dims, torch.bfloat16, torch.uint8, 2048).name == "TRITON"
        assert registry.select_sparse_backend("sparse_decode", dims, torch.bfloat16, torch.uint8, 2048,
                                              backend="REFERENCE").name == "REFERENCE"



def test_compiled_sparse_layer_matches_eager_over_mixed_steps():
    """A sparse MLAAttention inside Linear -> attention -> Linear under torch.compile(fullgraph=True): one opaque
    op (mla_sparse_attention) with the step's topk positions; the same outputs and cache as eager, no
    recompilation for new step compositions (dynamic shapes)."""
    from torch._dynamo.utils import counters

    from mla_multi.testing import PagedScenario

    torch._dynamo.reset()
    counters.clear()
    dims = mm.MLADims.deepseek_v3(num_heads=2)
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(2 * 256, 512, generator=generator) / 512**0.5
    layer = mm.MLAAttention(dims, dims.qk_head_dim**-0.5, weight, block_size=16, max_model_len=256, max_num_seqs=4,
                            sparse_topk=32)
    lin = torch.nn.Linear(2 * 128, 8)

    def model(q, kv_c, k_pe, cache, positions):
        return lin(layer.forward(q, kv_c, k_pe, cache, None, topk_indices=positions))

    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    scenario = PagedScenario(dims, 16, 32, torch.device("cpu"), torch.float32, seed=4)
    eager_cache = torch.full((32, 16, 576), float("nan"))
    compiled_cache = eager_cache.clone()
    with torch.inference_mode():
        for requests in ([(0, 20), (1, 9)], [(0, 1), (1, 1), (2, 12)], [(2, 1), (0, 1), (1, 5), (3, 7)]):
            metadata, q, kv_c, k_pe = scenario.step(requests)
            positions = scenario.topk_positions(requests, 24)
            layer.plan(metadata)
            expected = lin(layer.forward(q, kv_c, k_pe, eager_cache, metadata, topk_indices=positions))
            got = compiled(q, kv_c, k_pe, compiled_cache, positions)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled_cache, eager_cache, rtol=0, atol=0, equal_nan=True)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()


def test_sparse_decode_plans_once_per_layout_and_still_checks_the_data(monkeypatch):
    from mla_multi import ops, registry as registry_module

    ops._PLANS.clear()
    selections = []
    select = registry_module.select_sparse_backend

    def counting(*args, **kwargs):
        selections.append(args[0])
        return select(*args, **kwargs)

    monkeypatch.setattr(registry_module, "select_sparse_backend", counting)
    generator = torch.Generator().manual_seed(8)
    cache = torch.randn(4, 16, 576, generator=generator)
    q_nope, q_pe = torch.randn(3, 2, LKV, generator=generator), torch.randn(3, 2, ROPE, generator=generator)
    first = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, random_indices(generator, 3, 32, 64), 0.05)
    other = random_indices(generator, 3, 32, 64)
    second = mm.ops.mla_sparse_decode(q_nope, q_pe, cache, other, 0.05)
    assert len(selections) == 1  # the second call of the same layout reuses the plan
    ref, _ = naive_sparse(q_nope, q_pe, cache.view(-1, 576), other, 0.05)
    assert rel(second, ref) < 1e-5 and not torch.equal(first, second)
    other[1, 4] = 64  # bad data is still an error on a planned layout (the data checks run on CPU tensors)
    with pytest.raises(ValueError, match="indices hold"):
        mm.ops.mla_sparse_decode(q_nope, q_pe, cache, other, 0.05)
    mm.ops.mla_sparse_decode(q_nope, q_pe, cache.double().float(), other.clamp_max(63), 0.05, topk_length=None)
    mm.ops.mla_sparse_decode(q_nope[:2], q_pe[:2], cache, other[:2].clamp_max(63), 0.05)  # a new layout: planned
    assert len(selections) == 2


def _recording_decode(monkeypatch) -> list:
    """A recording stand-in for `mla_decode_fwd`: the keywords of each call go into the returned list."""
    from mla_multi.kernels import mla_decode

    calls = []

    def record(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, **keywords):
        calls.append(keywords)
        return keywords["out"], keywords["lse"]

    monkeypatch.setattr(mla_decode, "mla_decode_fwd", record)
    return calls


def _in_place_inputs(tokens: int, heads: int, topk: int, slots: int):
    """(q_nope, q_pe, pages, lists, lengths) for `TritonSparseDecodeImpl._decode_pages`: fp8_ds_mla pages
    of one token, every list whole."""
    q = torch.randn(tokens, heads, 576, dtype=torch.bfloat16)
    pages = torch.zeros(slots, 1, FP8_DS_MLA_BYTES, dtype=torch.uint8)
    lists = torch.randint(-1, slots, (tokens, topk), dtype=torch.int32)
    return q[..., :512], q[..., 512:], pages, lists, torch.full((tokens,), topk, dtype=torch.int32)


def test_triton_sparse_decode_reads_the_lists_through_the_dense_impls_launch(monkeypatch):
    """The index lists read as they are (masked entries) go through the dense decode impl's own launch path
    (its output, LSE and split partials), which passes `masked_entries` on to the kernels; the compacted
    tables go the same way without it (a recording stand-in for `mla_decode_fwd`)."""
    from mla_multi.backends.triton import TritonSparseDecodeImpl

    calls = _recording_decode(monkeypatch)
    impl = TritonSparseDecodeImpl(64, 512, 64, torch.device("cpu"))
    inputs = _in_place_inputs(3, 64, 128, 256)
    for masked in (True, False):
        out, lse = impl._decode_pages("masked" if masked else "in place", *inputs, 0.1)
        assert calls[-1]["masked_entries"] is masked and calls[-1]["out"] is out and calls[-1]["lse"] is lse
        assert out.shape == (3, 64, 512) and lse.shape == (3, 64) and lse.dtype == torch.float32
        assert calls[-1]["attn_logits"].shape[:3] == (3, 64, calls[-1]["num_kv_splits"])


def test_triton_sparse_decode_keeps_its_split_count_down_to_one_tile(monkeypatch):
    """One token of 128 heads over 2048 indices on an H200: the split count the sparse decode chooses with
    64-token splits (32; bench/RESULTS.md: 16.9 µs against 19.6 at 16) is the one its kernels get. The dense
    impl's launch bounded a given count by its own 128-token minimum and cut it to 16."""
    from mla_multi import platforms
    from mla_multi.backends.triton import TritonSparseDecodeImpl

    calls = _recording_decode(monkeypatch)
    with platforms.override("H200"):
        impl = TritonSparseDecodeImpl(128, 512, 64, torch.device("cpu"))
        inputs = _in_place_inputs(1, 128, 2048, 4096)
        for masked in (True, False):
            impl._decode_pages("masked" if masked else "in place", *inputs, 0.1)
            assert calls[-1]["num_kv_splits"] == 32, calls[-1]["num_kv_splits"]
            assert calls[-1]["attn_logits"].shape[2] == 32
