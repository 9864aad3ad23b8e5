"""TRITON's DeepSeek-V4 sparse MLA on the GPU (bfloat16) against REFERENCE in float64: every format pair,
64 and 128 heads, the [B, Q, N, 512] layout, the sink (finite, +inf, -inf), empty rows, the prefill over
float rows, bad indices without the data checks, and a CUDA graph replayed on new values."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import cache_formats as cf
from mla_multi.testing import capture_graph

pytestmark = pytest.mark.gpu

SCALE = 512 ** -0.5
PAIRS = [("fp8_ds_mla_v4", "fp8_ds_mla_v4"), ("fp8_ds_mla_v4", None), ("fp8_ds_mla_v41", "fp8_ds_mla_v41"),
         ("fp8_ds_mla_v41", "fp4_ds_mla_v41"), ("rows", "rows")]


def _skip_without_fp8(*formats):
    if any(f not in (None, "rows") for f in formats) and torch.version.hip is None \
            and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 V4 formats need sm_89+ (Triton's float8_e4m3fn conversion)")


def _cache(fmt_name, blocks, block_size, gen):
    """(the cache on the GPU, the same bytes on the CPU for REFERENCE)."""
    rows = torch.randn(blocks * block_size, 512, generator=gen) * torch.rand(blocks * block_size, 1, generator=gen) * 4
    if fmt_name == "rows":
        cache = rows.to(torch.bfloat16).reshape(blocks, block_size, 512)
        return cache.cuda(), cache
    fmt = cf.get_format(fmt_name)
    on_cpu = fmt.allocate(blocks, block_size)
    mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], on_cpu, torch.arange(blocks * block_size))
    on_gpu = fmt.allocate(blocks, block_size, "cuda", fill=0xFF)  # padding poisoned
    on_gpu.copy_(on_cpu)
    return on_gpu, on_cpu


def _indices(gen, lead, topk, slots):
    idx = torch.randint(0, slots, (*lead, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(*lead, topk, generator=gen) < 0.1] = -1
    idx.view(-1, topk)[0, 1] = idx.view(-1, topk)[0, 0]  # a duplicate counts twice
    return idx


def _check(out, lse, want, want_lse):
    got = out.double().cpu()
    assert not bool(got.isnan().any()) and not bool(lse.isnan().any())
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    empty = want_lse == -math.inf
    assert torch.equal(lse.cpu() == -math.inf, empty)
    assert not bool(got[empty].any())
    torch.testing.assert_close(lse.double().cpu()[~empty], want_lse[~empty], rtol=1e-3, atol=1e-3)


def _decode_case(main, extra, heads, batch, s_q, seed, extra_block_size=32):
    gen = torch.Generator().manual_seed(seed)
    lead = (batch, s_q) if s_q > 1 else (batch,)
    cache, cache_cpu = _cache(main, 16, 64, gen)
    q = torch.randn(*lead, heads, 512, generator=gen).to(torch.bfloat16)
    indices = _indices(gen, lead, 256, 16 * 64)
    lengths = torch.randint(0, 257, (batch,), generator=gen, dtype=torch.int32)
    lengths[0], lengths[-1] = 0, 256
    sink = torch.randn(heads, generator=gen)
    sink[1], sink[2] = math.inf, -math.inf
    kwargs = dict(topk_length=lengths, attn_sink=sink)
    cpu_kwargs = dict(kwargs)
    if extra is not None:
        extra_blocks = 128 // extra_block_size
        extra_cache, extra_cpu = _cache(extra, extra_blocks, extra_block_size, gen)
        extra_indices = _indices(gen, lead, 128, 128)
        extra_lengths = torch.randint(0, 129, (batch,), generator=gen, dtype=torch.int32)
        extra_lengths[0] = 0  # request 0: nothing at all
        kwargs.update(extra_kv_cache=extra_cache, extra_indices=extra_indices, extra_topk_length=extra_lengths)
        cpu_kwargs.update(extra_kv_cache=extra_cpu, extra_indices=extra_indices, extra_topk_length=extra_lengths)
    gpu_kwargs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    return q, cache, cache_cpu, indices, gpu_kwargs, cpu_kwargs


@pytest.mark.parametrize("main,extra", PAIRS, ids=lambda v: str(v))
@pytest.mark.parametrize("heads", [64, 128])
def test_decode_matches_reference(main, extra, heads):
    _skip_without_fp8(main, extra)
    q, cache, cache_cpu, indices, kwargs, cpu_kwargs = _decode_case(main, extra, heads, 6, 1, seed=heads)
    out, lse = mm.ops.mla_sparse_decode_v4(q.cuda(), cache, indices.cuda(), SCALE, backend="TRITON",
                                           return_lse=True, **kwargs)
    want, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache_cpu, indices, SCALE, backend="REFERENCE",
                                                 return_lse=True, **cpu_kwargs)
    _check(out, lse, want, want_lse)
    assert not bool(out[:, 1].any())  # the +inf sink: zeros


def _reads_v4_in_place() -> bool:
    """Whether this device's TRITON reads fp8_ds_mla_v4 caches in place (sm_90's warp-specialised kernels)."""
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason
    from mla_multi.platforms import current_platform

    return not ds_mla_decode_reason(current_platform())


def _impl(heads, gathered=False):
    """A TRITON sparse impl whose V4 calls read fp8_ds_mla_v4 caches its default way, or (`gathered`) with the
    rows dequantised first: an instance attribute, so that no plan the op keeps for the layout (`ops._PLANS`,
    whose launch is bound once) stands in for it."""
    from mla_multi.backends.triton import TritonSparseDecodeImpl

    impl = TritonSparseDecodeImpl(heads, 448, 64, "cuda")
    if gathered:
        impl.read_v4_in_place = False
    return impl


def _forward(impl, q, cache, indices, kwargs):
    """`impl.forward_v4` with the op's keywords (every call binds anew: no plan shared with other calls)."""
    given = {("extra_kv" if k == "extra_kv_cache" else k): v for k, v in kwargs.items()}
    extra = given.get("extra_kv")
    return impl.forward_v4(q, cache, indices, SCALE, kv_format="fp8_ds_mla_v4",
                           extra_kv_format=None if extra is None else "fp8_ds_mla_v4", **given)


@pytest.mark.parametrize("extra", ["fp8_ds_mla_v4", None])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_decode_in_place_matches_reference_and_the_gathered_rows(extra, heads):
    """Caches of one page size: read in place on sm_90 (the V4 loader of the warp-specialised kernel reading the
    index lists as they are), the same answer as REFERENCE in float64 and as the rows gathered first (an impl
    with `read_v4_in_place` off, called directly: the op's plan for the layout would keep the in-place launch):
    -1 entries, entries past topk_length, duplicates, empty tokens, the sink; 40 tokens (two splits at 128
    heads, one at 16 and 64)."""
    _skip_without_fp8("fp8_ds_mla_v4")
    q, cache, cache_cpu, indices, kwargs, cpu_kwargs = _decode_case("fp8_ds_mla_v4", extra, heads, 40, 1,
                                                                    seed=50 + heads, extra_block_size=64)
    impl, gathered_impl = _impl(heads), _impl(heads, gathered=True)
    reason = impl._v4_in_place_reason(q.cuda(), cache, "fp8_ds_mla_v4", kwargs.get("extra_kv_cache"), extra)
    assert (reason == "") == _reads_v4_in_place(), reason
    assert gathered_impl._v4_in_place_reason(q.cuda(), cache, "fp8_ds_mla_v4", kwargs.get("extra_kv_cache"), extra)
    out, lse = _forward(impl, q.cuda(), cache, indices.cuda(), kwargs)
    want, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache_cpu, indices, SCALE, backend="REFERENCE",
                                                 return_lse=True, **cpu_kwargs)
    _check(out, lse, want, want_lse)
    gathers = []
    real = gathered_impl._v4_pages
    gathered_impl._v4_pages = lambda *args, **keywords: gathers.append(1) or real(*args, **keywords)
    gathered, gathered_lse = _forward(gathered_impl, q.cuda(), cache, indices.cuda(), kwargs)
    assert gathers  # the rows were gathered first
    torch.testing.assert_close(out, gathered, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, gathered_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("width", [64, 192])
@pytest.mark.parametrize("heads", [64, 128])
def test_decode_reads_every_e4m3_byte_as_the_format_does(heads, width):
    """Each token's 448 latent bytes run through every e4m3 number (both zeros and the subnormals; a different
    rotation a token), its seven UE8M0 scales from 2^-20 to 2^20, its rotary part any bfloat16, and each token
    attends to one row alone (topk_length 1): the output row is the format's dequantisation exactly (bfloat16
    values, weight 1), for the in-place loader's conversion (sm_90) or the gathered rows' of every byte. Lists
    `width` wide: one tile a split (the loader's narrow pieces) or two and three (its wide pieces)."""
    _skip_without_fp8("fp8_ds_mla_v4")
    fmt = cf.get_format("fp8_ds_mla_v4")
    gen = torch.Generator().manual_seed(heads)
    tokens = 64
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7F, 0xFF: NaN
    records = torch.zeros(tokens, fmt.bytes_per_token, dtype=torch.uint8)
    records[:, :448] = codes[(torch.arange(448) + 37 * torch.arange(tokens)[:, None]) % codes.numel()]
    records[:, 448:576] = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16).view(torch.uint8).reshape(
        tokens, 128)
    records[:, 576:583] = (127 + torch.randint(-20, 21, (tokens, 7), generator=gen)).to(torch.uint8)
    cache = fmt.allocate(1, tokens, "cuda", fill=0xFF)
    fmt.write_records(cache, torch.arange(tokens, device="cuda"), records.cuda())
    order = torch.randperm(tokens, generator=gen)
    indices = torch.full((tokens, width), -1, dtype=torch.int32)
    indices[:, 0] = order
    q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16).cuda()
    out = mm.ops.mla_sparse_decode_v4(q, cache, indices.cuda(), SCALE, backend="TRITON",
                                      topk_length=torch.ones(tokens, dtype=torch.int32, device="cuda"))
    want = fmt.dequantize(records, torch.float64)[order]
    assert torch.equal(out.double().cpu(), want[:, None, :].expand(tokens, heads, 512))


@pytest.mark.parametrize("heads", [16, 128])
def test_decode_two_query_tokens_a_request(heads):
    _skip_without_fp8("fp8_ds_mla_v4")
    q, cache, cache_cpu, indices, kwargs, cpu_kwargs = _decode_case("fp8_ds_mla_v4", "fp8_ds_mla_v4", heads, 4, 2,
                                                                    seed=7, extra_block_size=64)
    out, lse = mm.ops.mla_sparse_decode_v4(q.cuda(), cache, indices.cuda(), SCALE, backend="TRITON",
                                           return_lse=True, **kwargs)
    want, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache_cpu, indices, SCALE, backend="REFERENCE",
                                                 return_lse=True, **cpu_kwargs)
    assert out.shape == (4, 2, heads, 512)
    _check(out, lse, want, want_lse)


def test_decode_replays_in_a_cuda_graph_on_new_values(monkeypatch):
    _skip_without_fp8("fp8_ds_mla_v4")
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")  # the data checks read the indices: not in a capture
    q, cache, cache_cpu, indices, kwargs, cpu_kwargs = _decode_case("fp8_ds_mla_v4", "fp8_ds_mla_v4", 64, 8, 1, seed=9,
                                                                    extra_block_size=64)
    q_gpu, idx_gpu = q.cuda(), indices.cuda()
    call = lambda: mm.ops.mla_sparse_decode_v4(q_gpu, cache, idx_gpu, SCALE, backend="TRITON", return_lse=True,
                                               **kwargs)
    call()  # planned and bound outside the capture
    captured = {}
    graph = capture_graph(lambda: captured.update(result=call()))
    out, lse = captured["result"]
    gen = torch.Generator().manual_seed(10)
    for _ in range(2):
        q_new = torch.randn(q.shape, generator=gen).to(torch.bfloat16)
        idx_new = _indices(gen, (8,), 256, 16 * 64)
        q_gpu.copy_(q_new)
        idx_gpu.copy_(idx_new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = mm.ops.mla_sparse_decode_v4(q_new.double(), cache_cpu, idx_new, SCALE, backend="REFERENCE",
                                                     return_lse=True, **cpu_kwargs)
        _check(out, lse, want, want_lse)
    eager, _ = call()  # an eager call after the capture: its own scratch still right (its loader may differ)
    torch.testing.assert_close(eager, out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("main", ["fp8_ds_mla_v4", "fp8_ds_mla_v41"])
def test_repeated_eager_calls_run_one_bound_launch_on_new_tensors(main):
    """The op binds a layout once (`MLASparseImpl.bind_v4`) and its later calls only launch: three calls on new
    tensors of the same layout (new addresses, new values, new lengths), each against REFERENCE in float64."""
    _skip_without_fp8(main)
    from mla_multi import ops

    launches = set()
    for call in range(3):
        q, cache, cache_cpu, indices, kwargs, cpu_kwargs = _decode_case(main, main, 64, 8, 1, seed=40 + call,
                                                                        extra_block_size=64)
        out, lse = mm.ops.mla_sparse_decode_v4(q.cuda(), cache, indices.cuda(), SCALE, backend="TRITON",
                                               return_lse=True, **kwargs)
        want, want_lse = mm.ops.mla_sparse_decode_v4(q.double(), cache_cpu, indices, SCALE, backend="REFERENCE",
                                                     return_lse=True, **cpu_kwargs)
        _check(out, lse, want, want_lse)
        plan = next(p for k, p in reversed(ops._PLANS.items()) if k[0] == "mla_sparse_decode_v4"
                    and p.backend_cls.name == "TRITON" and p.kv_format == main)
        launches.add(id(plan.launch))
    assert len(launches) == 1 and plan.launch is not None
    if main == "fp8_ds_mla_v4" and torch.cuda.get_device_capability() == (9, 0):
        # read in place through the index lists as they are: the dense kernels alone
        assert type(plan.launch).__name__ == "_V4InPlaceLaunch"


@pytest.mark.parametrize("heads", [64, 128])
def test_prefill_matches_reference(heads):
    gen = torch.Generator().manual_seed(20 + heads)
    tokens = 96
    kv = (torch.randn(700, 512, generator=gen) * 2).to(torch.bfloat16)
    extra_kv = torch.randn(130, 512, generator=gen).to(torch.bfloat16)
    q = torch.randn(tokens, heads, 512, generator=gen).to(torch.bfloat16)
    indices = torch.randint(-2, 720, (tokens, 512), generator=gen, dtype=torch.int32)  # past 700: no token
    extra_indices = torch.randint(-1, 130, (tokens, 64), generator=gen, dtype=torch.int32)
    lengths = torch.randint(0, 513, (tokens,), generator=gen, dtype=torch.int32)
    extra_lengths = torch.randint(0, 65, (tokens,), generator=gen, dtype=torch.int32)
    lengths[0] = extra_lengths[0] = 0
    sink = torch.randn(heads, generator=gen)
    sink[1], sink[2] = math.inf, -math.inf
    kwargs = dict(topk_length=lengths, attn_sink=sink, extra_kv=extra_kv, extra_indices=extra_indices,
                  extra_topk_length=extra_lengths)
    out, lse = mm.ops.mla_sparse_prefill_v4(q.cuda(), kv.cuda(), indices.cuda(), SCALE, backend="TRITON",
                                            return_lse=True, **{k: v.cuda() for k, v in kwargs.items()})
    want, want_lse = mm.ops.mla_sparse_prefill_v4(q.double(), kv, indices, SCALE, backend="REFERENCE",
                                                  return_lse=True, **kwargs)
    _check(out, lse, want, want_lse)


def test_bad_indices_without_the_data_checks_give_nan_rows_and_the_flag():
    from mla_multi import errors
    from mla_multi.backends.triton import TritonSparseDecodeImpl

    _skip_without_fp8("fp8_ds_mla_v4")
    gen = torch.Generator().manual_seed(30)
    cache, _ = _cache("fp8_ds_mla_v4", 2, 64, gen)
    q = torch.randn(4, 64, 512, generator=gen).to(torch.bfloat16).cuda()
    # token 1: -2 in the window; token 2: the window's slot count; token 3: the main cache's slot count past
    # its topk_length (bad wherever it lies)
    indices = torch.tensor([[0, 1], [2, -1], [3, 4], [5, 128]], dtype=torch.int32, device="cuda")
    extra_indices = torch.tensor([[0], [-2], [128], [1]], dtype=torch.int32, device="cuda")
    lengths = torch.tensor([2, 2, 2, 1], dtype=torch.int32, device="cuda")
    errors.error_flag(q.device).zero_()
    out, lse = TritonSparseDecodeImpl(64, 448, 64, q.device).forward_v4(
        q, cache, indices, SCALE, kv_format="fp8_ds_mla_v4", topk_length=lengths, extra_kv=cache,
        extra_indices=extra_indices, extra_kv_format="fp8_ds_mla_v4")
    assert bool(out[1:].isnan().all()) and bool(lse[1:].isnan().all())
    assert not bool(out[0].isnan().any())
    assert int(errors.error_flag(q.device)) & errors.SPARSE_INDEX
    errors.error_flag(q.device).zero_()
