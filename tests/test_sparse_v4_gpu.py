"""The V4 cache bytes cross-checked on the GPU: a 584-byte ``fp8_ds_mla_v4`` cache (and its second segment)
written by `concat_and_cache_mla_v4` is read by FlashMLA's own V4 sparse decode (`sgl-flash-mla`'s legacy
kernels: ``flash_mla_with_kvcache(..., use_legacy=True)`` with the sink, topk_length and the extra segment),
and its result equals the package's REFERENCE on the same cache (float64). Skipped without the wheel."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import cache_formats as cf

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
    if name != "fp8_ds_mla":  # the V4 formats: power-of-two scales, exact on every device
        assert torch.equal(fmt.read_records(back), fmt.read_records(on_cpu))
    else:  # amax / 448 scales: a last-bit difference between the devices' float32 division may round a value
        # to the next e4m3 step (one in 8)
        torch.testing.assert_close(fmt.dequantize(fmt.read_records(back)).float(),
                                   fmt.dequantize(fmt.read_records(on_cpu)).float(), rtol=0.13, atol=1e-3)
