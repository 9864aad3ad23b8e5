"""The V4 cache bytes cross-checked on the GPU: a 584-byte ``fp8_ds_mla_v4`` cache (and its second segment)
written by `concat_and_cache_mla_v4` is read by FlashMLA's own V4 sparse decode (`sgl-flash-mla`'s legacy
kernels: ``flash_mla_with_kvcache(..., use_legacy=True)`` with the sink, topk_length and the extra segment),
and its result equals the package's REFERENCE on the same cache (float64). The FLASHMLA backend through
`mm.ops.mla_sparse_decode_v4` / `mla_sparse_prefill_v4` against REFERENCE in float64 (the sink, both
segments, topk_length, empty rows, index lists padded to FlashMLA's tile, several query tokens a request),
eagerly and replayed from CUDA graphs with new data. Skipped without the wheel."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import cache_formats as cf
from mla_multi import registry
from mla_multi.dims import MLADims
from mla_multi.platforms import current_platform
from mla_multi.testing import capture_graph, v4_prefill_inputs

pytestmark = pytest.mark.gpu

WIDTH = 512


def _flash_mla():
    try:
        import flash_mla
    except Exception as error:  # any failure of the optional wheel is a reason to skip
        pytest.skip(f"FlashMLA's wheel sgl-flash-mla is not importable (pip install 'mla-multi[flashmla]'): "
                    f"{type(error).__name__}: {error}")
    has_legacy = getattr(flash_mla, "has_legacy", None)
    if has_legacy is None or not has_legacy():
        pytest.skip("the installed flash_mla has no legacy kernels (the V4 584-byte format is legacy-only)")
    if torch.cuda.get_device_capability() not in ((9, 0), (10, 0)):
        pytest.skip(f"FlashMLA's V4 sparse decode runs on sm_90 / sm_100, not {torch.cuda.get_device_capability()}")
    return flash_mla


def _written_cache(num_blocks, block_size, generator):
    """A V4 cache on the GPU written by the package's writer, every slot filled."""
    slots = num_blocks * block_size
    rows = (torch.randn(slots, WIDTH, generator=generator) * torch.rand(slots, 1, generator=generator) * 4)
    rows = rows.to(torch.bfloat16).cuda()
    cache = cf.FP8_DS_MLA_V4.allocate(num_blocks, block_size, "cuda", fill=None)
    mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], cache, torch.arange(slots, device="cuda"))
    return cache


def _to_cpu(cache):
    """The cache on the CPU with the format's padded block stride (Tensor.cpu would pack the blocks)."""
    copy = cf.FP8_DS_MLA_V4.allocate(cache.shape[0], cache.shape[1])
    copy.copy_(cache)
    return copy


def _indices(generator, batch, s_q, topk, slots):
    idx = torch.randint(0, slots, (batch, s_q, topk), generator=generator, dtype=torch.int32)
    idx[torch.rand(batch, s_q, topk, generator=generator) < 0.1] = -1
    idx[0, 0, 1] = idx[0, 0, 0]  # a duplicate counts twice
    return idx.cuda()


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
def test_flashmla_reads_the_package_v4_cache_as_reference_does(heads, s_q):
    flash_mla = _flash_mla()
    generator = torch.Generator().manual_seed(52 + heads + s_q)
    batch, topk, extra_topk = 4, 128, 64
    cache = _written_cache(8, 64, generator)  # the top-k segment: blocks of 64 (padded to 65 x 576 bytes)
    extra = _written_cache(4, 64, generator)  # the window segment, its own cache
    q = (torch.randn(batch, s_q, heads, WIDTH, generator=generator)).to(torch.bfloat16).cuda()
    indices = _indices(generator, batch, s_q, topk, 8 * 64)
    extra_indices = _indices(generator, batch, s_q, extra_topk, 4 * 64)
    topk_length = torch.tensor([topk, 70, 0, 5], dtype=torch.int32, device="cuda")
    extra_topk_length = torch.tensor([extra_topk, 0, 0, 33], dtype=torch.int32, device="cuda")  # request 2: empty
    sink = torch.randn(heads, generator=generator).cuda()
    sink[1], sink[2] = math.inf, -math.inf
    scale = WIDTH ** -0.5

    sched, _ = flash_mla.get_mla_metadata()
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, cache.unsqueeze(2), None, None, WIDTH, sched, softmax_scale=scale, is_fp8_kvcache=True, indices=indices,
        attn_sink=sink, extra_k_cache=extra.unsqueeze(2), extra_indices_in_kvcache=extra_indices,
        topk_length=topk_length, extra_topk_length=extra_topk_length, use_legacy=True, kv_format="V4",
    )
    torch.cuda.synchronize()
    lse = lse.transpose(1, 2)  # [B, s_q, H]

    want, want_lse = mm.ops.mla_sparse_decode_v4(
        q.double().cpu(), _to_cpu(cache), indices.cpu(), scale, topk_length=topk_length.cpu(), attn_sink=sink.cpu(),
        extra_kv_cache=_to_cpu(extra), extra_indices=extra_indices.cpu(), extra_topk_length=extra_topk_length.cpu(),
        backend="REFERENCE", return_lse=True,
    )
    empty = want_lse == -math.inf  # FlashMLA reports +inf for a token with nothing to attend to
    assert bool(empty[2].all())  # request 2: topk_length 0 and the window empty
    got = out.double().cpu()
    # FlashMLA's kernel runs its products in bf16 (P rounded to bf16 before P V): within bf16's 1e-2 by relative
    # norm (the project's bound against float64), each row too
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    rows = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)
    assert float(rows[want.norm(dim=-1) > 0].max()) < 3e-2
    got_lse = lse.double().cpu()
    assert bool((got_lse[empty] == math.inf).all())
    torch.testing.assert_close(got_lse[~empty], want_lse[~empty], rtol=1e-4, atol=1e-4)
    assert not bool(got[:, :, 1].any())  # the +inf sink: zeros


@pytest.mark.parametrize("name", list(cf.FORMATS))
def test_the_writer_on_the_gpu_writes_the_cpu_bytes(name):
    """The writer on the device gives the bytes it gives on the CPU (the CPU's equal FlashMLA's quantiser's)."""
    fmt = cf.get_format(name)
    generator = torch.Generator().manual_seed(11)
    rows = (torch.randn(96, fmt.width, generator=generator) * 5).to(torch.bfloat16)
    slots = torch.randperm(128, generator=generator)[:96]
    latent = fmt.width - fmt.rope_dims
    on_cpu = fmt.allocate(2, 64)
    mm.ops.concat_and_cache_mla_v4(rows[:, :latent], rows[:, latent:], on_cpu, slots)
    on_gpu = fmt.allocate(2, 64, "cuda")
    mm.ops.concat_and_cache_mla_v4(rows[:, :latent].cuda(), rows[:, latent:].cuda(), on_gpu, slots.cuda())
    back = fmt.allocate(2, 64)
    back.copy_(on_gpu)
    # every format byte for byte, fp8_ds_mla's amax / 448 scales too: the kernel divides as IEEE float32 does
    assert torch.equal(fmt.read_records(back), fmt.read_records(on_cpu))


@pytest.mark.parametrize("name", list(cf.FORMATS))
def test_the_writers_replay_from_a_cuda_graph_with_new_rows_and_slots(name, monkeypatch):
    """The writer (one kernel launch, no host synchronisation) captured in a CUDA graph: replayed with new rows
    and slots (one skipped, one past the cache: flagged) in the captured buffers, the cache's bytes are the
    CPU writer's; for fp8_ds_mla through `concat_and_cache_mla` (the V3.2 sparse layer's writer) too."""
    from mla_multi import errors

    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")  # the slot past the cache is the kernel's to flag
    fmt = cf.get_format(name)
    latent = fmt.width - fmt.rope_dims
    tokens, blocks, block_size = 24, 3, 16
    static_rows = torch.zeros(tokens, fmt.width, dtype=torch.bfloat16, device="cuda")
    static_slots = torch.zeros(tokens, dtype=torch.int64, device="cuda")
    cache = fmt.allocate(blocks, block_size, "cuda")
    errors.error_flag(cache.device)
    writer = mm.ops.concat_and_cache_mla if name == "fp8_ds_mla" else mm.ops.concat_and_cache_mla_v4
    graph = capture_graph(lambda: writer(static_rows[:, :latent], static_rows[:, latent:], cache, static_slots))
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        rows = (torch.randn(tokens, fmt.width, generator=generator) * 3).to(torch.bfloat16)
        slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
        slots[3], slots[7] = -1, blocks * block_size
        static_rows.copy_(rows)
        static_slots.copy_(slots)
        cache.zero_()
        errors.error_flag(cache.device).zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert int(errors.error_flag(cache.device)) & errors.SLOT
        on_cpu = fmt.allocate(blocks, block_size)
        kept = (slots >= 0) & (slots < blocks * block_size)
        fmt.write_records(on_cpu, slots[kept], fmt.quantize(rows[kept]))
        back = fmt.allocate(blocks, block_size)
        back.copy_(cache)
        assert torch.equal(fmt.read_records(back), fmt.read_records(on_cpu))
    errors.error_flag(cache.device).zero_()


# --------------------------------------------------------------------------- the FLASHMLA backend (V4 contract)


def _need_flashmla(phase, heads, kv_format, extra_kv_format=None, kv_dtype=torch.uint8, topk=640):
    _flash_mla()
    config = registry.sparse_config(MLADims(heads, kv_lora_rank=448, qk_rope_head_dim=64), torch.bfloat16,
                                    kv_dtype, topk, kv_format=kv_format, extra_kv_format=extra_kv_format,
                                    with_sink=True, with_lengths=True)
    reasons = registry.default_registry.reasons(phase, "FLASHMLA", current_platform(), config)
    if reasons:
        pytest.skip(f"FLASHMLA cannot run this V4 case here: {reasons[0]}")


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    assert bool(torch.isfinite(a).all())
    return ((a - b).norm() / b.norm()).item()


def _check_lse(lse, want):
    empty = want == -math.inf
    got = lse.double().cpu()
    assert bool((got[empty] == -math.inf).all())  # the package's -inf, not FlashMLA's +inf
    torch.testing.assert_close(got[~empty], want[~empty], rtol=1e-4, atol=1e-4)


def _decode_inputs(generator, batch, s_q, heads, topk, extra_topk):
    cache = _written_cache(8, 64, generator)
    extra = _written_cache(4, 64, generator)
    q = torch.randn(batch, s_q, heads, WIDTH, generator=generator).to(torch.bfloat16).cuda()
    indices = _indices(generator, batch, s_q, topk, 8 * 64)
    extra_indices = _indices(generator, batch, s_q, extra_topk, 4 * 64)
    topk_length = torch.tensor([topk, topk // 2, 0, 5][:batch], dtype=torch.int32, device="cuda")
    extra_topk_length = torch.tensor([extra_topk, 0, 0, 33 % (extra_topk + 1)][:batch], dtype=torch.int32,
                                     device="cuda")  # request 2: nothing to attend to
    sink = torch.randn(heads, generator=generator).cuda()
    sink[1], sink[2] = math.inf, -math.inf
    return cache, extra, q, indices, extra_indices, topk_length, extra_topk_length, sink


def _reference_decode(q, cache, indices, extra, extra_indices, topk_length, extra_topk_length, sink):
    return mm.ops.mla_sparse_decode_v4(
        q.double().cpu(), _to_cpu(cache), indices.cpu(), WIDTH ** -0.5, topk_length=topk_length.cpu(),
        attn_sink=sink.cpu(), extra_kv_cache=_to_cpu(extra), extra_indices=extra_indices.cpu(),
        extra_topk_length=extra_topk_length.cpu(), backend="REFERENCE", return_lse=True)


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("topk,extra_topk", [(128, 64), (100, 40)])
def test_flashmla_backend_v4_decode_matches_reference(heads, s_q, topk, extra_topk):
    _need_flashmla("sparse_decode", heads, "fp8_ds_mla_v4", "fp8_ds_mla_v4")
    generator = torch.Generator().manual_seed(61 + heads + s_q + topk)
    cache, extra, q, indices, extra_indices, lengths, extra_lengths, sink = _decode_inputs(
        generator, 4, s_q, heads, topk, extra_topk)
    out, lse = mm.ops.mla_sparse_decode_v4(
        q, cache, indices, WIDTH ** -0.5, topk_length=lengths, attn_sink=sink, extra_kv_cache=extra,
        extra_indices=extra_indices, extra_topk_length=extra_lengths, backend="FLASHMLA", return_lse=True)
    want, want_lse = _reference_decode(q, cache, indices, extra, extra_indices, lengths, extra_lengths, sink)
    assert out.shape == (4, s_q, heads, WIDTH) and lse.shape == (4, s_q, heads)
    assert _rel(out, want) < 1e-2
    assert bool((want_lse[2] == -math.inf).all()) and not bool(out[2].any())  # empty: 0 and -inf
    assert not bool(out[:, :, 1].any())  # the +inf sink
    _check_lse(lse, want_lse)


def test_flashmla_backend_v4_decode_replays_from_a_cuda_graph_with_new_data(monkeypatch):
    """Captured after an eager call (the layout's schedule made then, reused by the graph), replayed with new
    queries, indices and length values in the same buffers; and a layout first seen inside a capture (its
    schedule made in the graph, kept for no other call), replayed, then called eagerly."""
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")  # the data checks read the indices on the host
    heads = 128
    _need_flashmla("sparse_decode", heads, "fp8_ds_mla_v4", "fp8_ds_mla_v4")
    generator = torch.Generator().manual_seed(71)
    cache, extra, q, indices, extra_indices, lengths, extra_lengths, sink = _decode_inputs(
        generator, 4, 1, heads, 512, 128)
    q, indices, extra_indices = q[:, 0], indices[:, 0], extra_indices[:, 0]
    result = {}

    def step():
        result["out"] = mm.ops.mla_sparse_decode_v4(
            q, cache, indices, WIDTH ** -0.5, topk_length=lengths, attn_sink=sink, extra_kv_cache=extra,
            extra_indices=extra_indices, extra_topk_length=extra_lengths, backend="FLASHMLA")

    graph = capture_graph(step)  # one eager call first (on a side stream), then the capture
    for seed in (1, 2):
        fresh = _decode_inputs(torch.Generator().manual_seed(seed), 4, 1, heads, 512, 128)
        q.copy_(fresh[2][:, 0])
        indices.copy_(fresh[3][:, 0])
        extra_indices.copy_(fresh[4][:, 0])
        lengths.copy_(fresh[5].roll(seed))
        extra_lengths.copy_(fresh[6].roll(seed))
        result["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = _reference_decode(q.unsqueeze(1), cache, indices.unsqueeze(1), extra, extra_indices.unsqueeze(1),
                                    lengths, extra_lengths, sink)
        assert _rel(result["out"], want[:, 0]) < 1e-2

    # a layout (3 tokens) whose first call is captured
    q3, indices3, extra3 = q[:3].clone(), indices[:3].clone(), extra_indices[:3].clone()
    lengths3, extra_lengths3 = lengths[:3].clone(), extra_lengths[:3].clone()

    def step3():
        return mm.ops.mla_sparse_decode_v4(
            q3, cache, indices3, WIDTH ** -0.5, topk_length=lengths3, attn_sink=sink, extra_kv_cache=extra,
            extra_indices=extra3, extra_topk_length=extra_lengths3, backend="FLASHMLA")

    graph3 = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph3, stream=stream):
        result["out3"] = step3()
    graph3.replay()
    torch.cuda.synchronize()
    want, _ = _reference_decode(q3.unsqueeze(1), cache, indices3.unsqueeze(1), extra, extra3.unsqueeze(1), lengths3,
                                extra_lengths3, sink)
    assert _rel(result["out3"], want[:, 0]) < 1e-2
    assert _rel(step3(), want[:, 0]) < 1e-2  # eagerly after the capture: a schedule of its own


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("topk,s_kv", [(2048, 4096), (200, 700)])
def test_flashmla_backend_v4_prefill_matches_reference(heads, topk, s_kv):
    _need_flashmla("sparse_prefill", heads, "rows", kv_dtype=torch.bfloat16, topk=topk)
    case = v4_prefill_inputs(heads, topk, s_kv, seed=heads + topk)  # indices outside [0, s_kv): no token
    q, kv, indices, lengths, sink = (case[k] for k in ("q", "kv", "indices", "topk_length", "attn_sink"))
    for topk_length, attn_sink in ((None, None), (lengths, sink)):
        out, lse = mm.ops.mla_sparse_prefill_v4(
            q.cuda(), kv.cuda(), indices.cuda(), WIDTH ** -0.5,
            topk_length=None if topk_length is None else topk_length.cuda(),
            attn_sink=None if attn_sink is None else attn_sink.cuda(), backend="FLASHMLA", return_lse=True)
        want, want_lse = mm.ops.mla_sparse_prefill_v4(
            q.double(), kv.double(), indices, WIDTH ** -0.5, topk_length=topk_length, attn_sink=attn_sink,
            backend="REFERENCE", return_lse=True)
        assert _rel(out, want) < 1e-2
        assert bool((lse[1] == -math.inf).all()) and not bool(out[1].any())
        _check_lse(lse, want_lse)


def test_flashmla_backend_v4_prefill_replays_from_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "0")
    heads, topk, s_kv, tokens = 128, 512, 2048, 64
    _need_flashmla("sparse_prefill", heads, "rows", kv_dtype=torch.bfloat16, topk=topk)
    generator = torch.Generator().manual_seed(81)
    kv = torch.randn(s_kv, WIDTH, generator=generator).to(torch.bfloat16).cuda()
    q = torch.randn(tokens, heads, WIDTH, generator=generator).to(torch.bfloat16).cuda()
    indices = torch.randint(-1, s_kv, (tokens, topk), generator=generator, dtype=torch.int32).cuda()
    lengths = torch.randint(0, topk + 1, (tokens,), generator=generator, dtype=torch.int32).cuda()
    sink = torch.randn(heads, generator=generator).cuda()
    result = {}

    def step():
        result["out"] = mm.ops.mla_sparse_prefill_v4(q, kv, indices, WIDTH ** -0.5, topk_length=lengths,
                                                     attn_sink=sink, backend="FLASHMLA")

    graph = capture_graph(step)
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        indices.copy_(torch.randint(-1, s_kv, (tokens, topk), generator=g, dtype=torch.int32))
        lengths.copy_(torch.randint(0, topk + 1, (tokens,), generator=g, dtype=torch.int32))
        result["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = mm.ops.mla_sparse_prefill_v4(q.double().cpu(), kv.double().cpu(), indices.cpu(), WIDTH ** -0.5,
                                            topk_length=lengths.cpu(), attn_sink=sink.cpu(), backend="REFERENCE")
        assert _rel(result["out"], want) < 1e-2


@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_backend_v4_decode_bad_indices_in_either_list_give_nan_rows_and_the_flag(heads):
    """Both lists sanitised by one launch (`SparseIndexPlan.sanitize_pair`): a bad index in the top-k list
    (token 0, past its topk_length too: bad wherever it lies) or in the window (token 2) makes that token's rows
    and LSE NaN and sets the flag, FlashMLA never reading it; the other tokens match REFERENCE."""
    from mla_multi import errors
    from mla_multi.backends.flashmla import FlashMLASparseDecodeImpl

    _need_flashmla("sparse_decode", heads, "fp8_ds_mla_v4", "fp8_ds_mla_v4")
    generator = torch.Generator().manual_seed(90 + heads)
    cache, extra, q, indices, extra_indices, lengths, extra_lengths, sink = _decode_inputs(
        generator, 4, 1, heads, 128, 64)
    q, indices, extra_indices = q[:, 0], indices[:, 0].contiguous(), extra_indices[:, 0].contiguous()
    indices[0, 127] = 8 * 64  # the cache's slot count, past token 0's topk_length
    lengths[0] = 100
    extra_indices[2, 3] = -5
    errors.error_flag(q.device).zero_()
    out, lse = FlashMLASparseDecodeImpl(heads, 448, 64, q.device).forward_v4(
        q, cache, indices, WIDTH ** -0.5, kv_format="fp8_ds_mla_v4", topk_length=lengths, attn_sink=sink,
        extra_kv=extra, extra_indices=extra_indices, extra_topk_length=extra_lengths,
        extra_kv_format="fp8_ds_mla_v4")
    torch.cuda.synchronize()
    assert int(errors.error_flag(q.device)) & errors.SPARSE_INDEX
    errors.error_flag(q.device).zero_()
    for token in (0, 2):
        assert bool(out[token].isnan().all()) and bool(lse[token].isnan().all())
    good = [1, 3]
    want, want_lse = _reference_decode(q[good].unsqueeze(1), cache, indices[good].unsqueeze(1), extra,
                                       extra_indices[good].unsqueeze(1), lengths[good], extra_lengths[good], sink)
    assert _rel(out[good], want[:, 0]) < 1e-2
    _check_lse(lse[good], want_lse[:, 0])


def test_flashmla_backend_v4_decode_later_eager_calls_reuse_the_first_calls_buffers(monkeypatch):
    """A bound V4 decode (`bind_v4`) called three times eagerly: the first sanitises into the plan's scratch and
    keeps it (`SparseIndexPlan.keep`), the later ones launch into the kept buffers by their addresses
    (`SparseIndexPlan.eager_kept`), each with new queries and lists against REFERENCE; the third passes another
    cache tensor (its paged view made anew) and a bad index in token 1's window, whose rows and LSE become NaN,
    the flag set; a fourth call under a Triton launch hook passes the kept tensors."""
    from triton import knobs

    from mla_multi import errors
    from mla_multi.backends.flashmla import FlashMLASparseDecodeImpl

    _need_flashmla("sparse_decode", 128, "fp8_ds_mla_v4", "fp8_ds_mla_v4")
    generator = torch.Generator().manual_seed(77)
    cache, extra, q, indices, extra_indices, lengths, extra_lengths, sink = _decode_inputs(
        generator, 4, 1, 128, 128, 64)
    impl = FlashMLASparseDecodeImpl(128, 448, 64, q.device)
    launch = impl.bind_v4(q[:, 0], cache, indices[:, 0].contiguous(), kv_format="fp8_ds_mla_v4",
                          topk_length=lengths, attn_sink=sink, extra_kv=extra,
                          extra_indices=extra_indices[:, 0].contiguous(), extra_topk_length=extra_lengths,
                          extra_kv_format="fp8_ds_mla_v4")
    errors.error_flag(q.device).zero_()
    for call in range(3):
        if call:
            q = torch.randn(q.shape, generator=generator).to(torch.bfloat16).cuda()
            indices = _indices(generator, 4, 1, 128, 8 * 64)
            extra_indices = _indices(generator, 4, 1, 64, 4 * 64)
        if call == 2:
            cache = cache.clone()
            extra_indices[1, 0, 5] = 4 * 64  # past the window's cache
        out, lse = launch(q[:, 0], cache, indices[:, 0].contiguous(), WIDTH ** -0.5, topk_length=lengths,
                          attn_sink=sink, extra_kv=extra, extra_indices=extra_indices[:, 0].contiguous(),
                          extra_topk_length=extra_lengths)
        torch.cuda.synchronize()
        assert launch.eager is not None
        good = [0, 2, 3] if call == 2 else [0, 1, 2, 3]
        want, want_lse = _reference_decode(q[good], cache, indices[good], extra, extra_indices[good], lengths[good],
                                           extra_lengths[good], sink)
        assert _rel(out[good], want[:, 0]) < 1e-2
        _check_lse(lse[good], want_lse[:, 0])
        flagged = int(errors.error_flag(q.device)) & errors.SPARSE_INDEX
        assert bool(flagged) == (call == 2)
        if call == 2:
            assert bool(out[1].isnan().all()) and bool(lse[1].isnan().all())
    errors.error_flag(q.device).zero_()
    # a Triton launch hook (a profiler's) sends bound launches through Triton's own launch: the kept buffers go
    # as tensors then (an int would be typed as an integer), and the call still gives REFERENCE's result
    plan = launch.call.index_plan
    assert isinstance(plan.eager_kept()[0], int)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)
    assert isinstance(plan.eager_kept()[0], torch.Tensor)
    q = torch.randn(q.shape, generator=generator).to(torch.bfloat16).cuda()
    indices = _indices(generator, 4, 1, 128, 8 * 64)
    extra_indices = _indices(generator, 4, 1, 64, 4 * 64)
    out, lse = launch(q[:, 0], cache, indices[:, 0].contiguous(), WIDTH ** -0.5, topk_length=lengths,
                      attn_sink=sink, extra_kv=extra, extra_indices=extra_indices[:, 0].contiguous(),
                      extra_topk_length=extra_lengths)
    torch.cuda.synchronize()
    want, want_lse = _reference_decode(q, cache, indices, extra, extra_indices, lengths, extra_lengths, sink)
    assert _rel(out, want[:, 0]) < 1e-2
    _check_lse(lse, want_lse[:, 0])
    assert not int(errors.error_flag(q.device)) & errors.SPARSE_INDEX


@pytest.mark.parametrize("name", list(cf.FORMATS))
def test_the_writers_plan_once_a_layout_and_still_check_the_slots(name, monkeypatch):
    """The byte-format writers keep a plan a layout, as `concat_and_cache_mla` does: a second call of the
    layout runs no tensor check (one plan in `ops._PLANS`) and writes its new rows' bytes (the CPU's); with
    the data checks on, a planned call given a slot past the cache still raises ValueError naming
    slot_mapping."""
    from mla_multi import checks, ops

    monkeypatch.setenv("MLA_MULTI_CHECK_INPUTS", "1")
    monkeypatch.setattr(ops, "_PLANS", {})
    tensor_checks = []
    original = checks.check_tensor
    monkeypatch.setattr(checks, "check_tensor", lambda *a, **k: tensor_checks.append(a[0]) or original(*a, **k))
    fmt = cf.get_format(name)
    latent = fmt.width - fmt.rope_dims
    writer, op_name = ((mm.ops.concat_and_cache_mla, "concat_and_cache_mla") if name == "fp8_ds_mla"
                       else (mm.ops.concat_and_cache_mla_v4, "concat_and_cache_mla_v4"))
    cache = fmt.allocate(2, 64, "cuda")
    for call in range(2):
        generator = torch.Generator().manual_seed(30 + call)
        rows = (torch.randn(16, fmt.width, generator=generator) * 2).to(torch.bfloat16)
        slots = torch.randperm(128, generator=generator)[:16]
        checked = len(tensor_checks)
        writer(rows[:, :latent].cuda(), rows[:, latent:].cuda(), cache, slots.cuda())
        assert (len(tensor_checks) > checked) == (call == 0), tensor_checks
        assert len([key for key in ops._PLANS if key[0] == op_name]) == 1
        on_cpu = fmt.allocate(2, 64)
        fmt.write_records(on_cpu, slots, fmt.quantize(rows))
        back = fmt.allocate(2, 64)
        back.copy_(cache)
        assert torch.equal(fmt.read_records(back, slots), fmt.read_records(on_cpu, slots))
    slots[3] = 128
    with pytest.raises(ValueError, match="slot_mapping"):
        writer(rows[:, :latent].cuda(), rows[:, latent:].cuda(), cache, slots.cuda())
