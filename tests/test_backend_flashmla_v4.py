"""FLASHMLA under the DeepSeek-V4 contract on the CPU: `mm.ops.mla_sparse_decode_v4` / `mla_sparse_prefill_v4`
with backend="FLASHMLA" against REFERENCE in float64, through the PyTorch stand-in of FlashMLA
(tests/fake_flash_mla, which checks FlashMLA's argument rules and refuses a schedule reused with other
length values) on impersonated NVIDIA platforms: the sink, both segments, topk_length, empty rows, index
lists padded to FlashMLA's tile, several query tokens a request, one schedule per layout, bad indices,
the V4.1 formats on sm_100, and the reasons FLASHMLA gives where it declines. The real kernels run in
tests/test_sparse_v4_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

import mla_multi as mm
from mla_multi import cache_formats as cf
from mla_multi import errors, registry
from mla_multi.backends import flashmla
from mla_multi.dims import MLADims
from mla_multi.platforms import override
from mla_multi.testing import v4_prefill_inputs

WIDTH = 512
SCALE = WIDTH ** -0.5


def _cache(fmt, blocks, block_size, generator):
    """A cache of `fmt` with every slot written by the package's writer."""
    slots = blocks * block_size
    rows = torch.randn(slots, WIDTH, generator=generator) * torch.rand(slots, 1, generator=generator) * 3
    cache = fmt.allocate(blocks, block_size)
    mm.ops.concat_and_cache_mla_v4(rows[:, :448], rows[:, 448:], cache, torch.arange(slots))
    return cache


def _rel(a, b):
    a, b = a.double(), b.double()
    assert bool(torch.isfinite(a).all())
    return ((a - b).norm() / b.norm()).item()


def _decode(backend, q, kv, indices, **extra):
    if backend == "REFERENCE":
        q = q.double()
    return mm.ops.mla_sparse_decode_v4(q, kv, indices, SCALE, backend=backend, return_lse=True, **extra)


def _v4_calls(module):
    return [c for c in module.CALLS if c["function"] == "flash_mla_with_kvcache" and c.get("v4")]


def _check_lse(lse, want):
    """-inf where REFERENCE has -inf (FlashMLA's +inf mapped), equal elsewhere (natural log both)."""
    empty = want == -math.inf
    assert bool((lse[empty] == -math.inf).all())
    torch.testing.assert_close(lse[~empty].double(), want[~empty].double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("topk,extra_topk", [(128, 64), (100, 40)])
def test_v4_decode_matches_reference_with_sink_both_segments_and_lengths(fake_flash_mla, heads, topk, extra_topk):
    generator = torch.Generator().manual_seed(heads + topk)
    tokens = 5
    kv = _cache(cf.FP8_DS_MLA_V4, 6, 64, generator)
    window = _cache(cf.FP8_DS_MLA_V4, 2, 64, generator)  # the window segment: its own cache
    q = torch.randn(tokens, heads, WIDTH, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 6 * 64, (tokens, topk), generator=generator, dtype=torch.int32)
    indices[0, 1] = indices[0, 0] = 7  # a duplicate counts twice
    extra_indices = torch.randint(-1, 2 * 64, (tokens, extra_topk), generator=generator, dtype=torch.int32)
    lengths = torch.tensor([topk, topk // 2, 0, 3, topk], dtype=torch.int32)
    extra_lengths = torch.tensor([extra_topk, 0, 0, 5, extra_topk // 3], dtype=torch.int32)  # token 2: nothing
    sink = torch.randn(heads, generator=generator)
    sink[1], sink[2] = math.inf, -math.inf
    keywords = dict(topk_length=lengths, attn_sink=sink, extra_kv_cache=window, extra_indices=extra_indices,
                    extra_topk_length=extra_lengths)
    want, want_lse = _decode("REFERENCE", q, kv, indices, **keywords)
    with override("H200"):
        out, lse = _decode("FLASHMLA", q, kv, indices, **keywords)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (tokens, heads)
    assert _rel(out, want) < 1e-2
    assert bool((want_lse[2] == -math.inf).all()) and not bool(out[2].any())  # empty: 0 and -inf
    assert not bool(out[:, 1].any())  # the +inf sink
    _check_lse(lse, want_lse)
    call = _v4_calls(fake_flash_mla)[-1]
    # the legacy kernels named by FlashMLA's format name; lengths folded into the lists (no length values for
    # the schedule to depend on); lists padded to FlashMLA's tile of 64
    assert call["use_legacy"] and call["kv_format"] == "V4" and call["attn_sink"]
    assert call["topk_length"] is None and call["extra_topk_length"] is None
    assert call["topk"] == -(-topk // 64) * 64 and call["extra_topk"] == -(-extra_topk // 64) * 64


def test_v4_decode_without_the_second_segment_and_without_lengths(fake_flash_mla):
    generator = torch.Generator().manual_seed(3)
    kv = _cache(cf.FP8_DS_MLA_V4, 4, 32, generator)  # pages of 32
    q = torch.randn(3, 64, WIDTH, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 128, (3, 64), generator=generator, dtype=torch.int32)
    indices[1] = -1
    want, want_lse = _decode("REFERENCE", q, kv, indices)
    with override("H100"):
        out, lse = _decode("FLASHMLA", q, kv, indices)
    assert _rel(out, want) < 1e-2
    _check_lse(lse, want_lse)
    assert bool((lse[1] == -math.inf).all()) and not bool(out[1].any())


def test_v4_decode_several_query_tokens_a_request(fake_flash_mla):
    """q [B, Q, N, 512] (MTP): every token its own FlashMLA request, the request's lengths for each."""
    generator = torch.Generator().manual_seed(4)
    batch, q_len, heads = 3, 2, 128
    kv = _cache(cf.FP8_DS_MLA_V4, 4, 64, generator)
    window = _cache(cf.FP8_DS_MLA_V4, 2, 64, generator)
    q = torch.randn(batch, q_len, heads, WIDTH, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 256, (batch, q_len, 128), generator=generator, dtype=torch.int32)
    extra_indices = torch.randint(-1, 128, (batch, q_len, 64), generator=generator, dtype=torch.int32)
    keywords = dict(topk_length=torch.tensor([128, 9, 0], dtype=torch.int32), attn_sink=torch.zeros(heads),
                    extra_kv_cache=window, extra_indices=extra_indices,
                    extra_topk_length=torch.tensor([64, 64, 0], dtype=torch.int32))
    want, want_lse = _decode("REFERENCE", q, kv, indices, **keywords)
    with override("H200"):
        out, lse = _decode("FLASHMLA", q, kv, indices, **keywords)
    assert out.shape == (batch, q_len, heads, WIDTH) and lse.shape == (batch, q_len, heads)
    assert _rel(out, want) < 1e-2
    _check_lse(lse, want_lse)


def test_v4_decode_schedule_is_made_once_per_layout_and_reused(fake_flash_mla):
    """New indices and new length values for the same layout reuse the first call's schedule (the stand-in
    raises when a schedule is reused with other length values: none reach FlashMLA); another layout gets its
    own."""
    generator = torch.Generator().manual_seed(5)
    kv = _cache(cf.FP8_DS_MLA_V4, 4, 64, generator)
    window = _cache(cf.FP8_DS_MLA_V4, 2, 64, generator)
    q = torch.randn(4, 64, WIDTH, generator=generator).to(torch.bfloat16)
    with override("H200"):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            indices = torch.randint(-1, 256, (4, 128), generator=g, dtype=torch.int32)
            extra = torch.randint(-1, 128, (4, 64), generator=g, dtype=torch.int32)
            lengths = torch.randint(0, 129, (4,), generator=g, dtype=torch.int32)
            extra_lengths = torch.randint(0, 65, (4,), generator=g, dtype=torch.int32)
            keywords = dict(topk_length=lengths, extra_kv_cache=window, extra_indices=extra,
                            extra_topk_length=extra_lengths)
            out, _ = _decode("FLASHMLA", q, kv, indices, **keywords)
            want, _ = _decode("REFERENCE", q, kv, indices, **keywords)
            assert _rel(out, want) < 1e-2
        calls = _v4_calls(fake_flash_mla)
        assert len(calls) == 3 and [c["scheduled"] for c in calls] == [True, False, False]
        assert len({c["schedule_id"] for c in calls}) == 1
        # through FlashMLA's op itself (`legacy_sparse_decode_op`): no schedule given to the first call, the kept
        # one to every later call
        direct = [c for c in fake_flash_mla.CALLS if c["function"] == "sparse_decode_fwd"]
        assert [c["given_schedule"] for c in direct] == [False, True, True]
        _decode("FLASHMLA", q[:2], kv, indices[:2])  # another layout: its own schedule
        assert _v4_calls(fake_flash_mla)[-1]["scheduled"]


def test_v4_decode_bad_indices_in_either_segment_never_reach_flashmla(fake_flash_mla, monkeypatch):
    generator = torch.Generator().manual_seed(6)
    kv = _cache(cf.FP8_DS_MLA_V4, 2, 64, generator)
    window = _cache(cf.FP8_DS_MLA_V4, 1, 64, generator)
    q = torch.randn(3, 64, WIDTH, generator=generator).to(torch.bfloat16)
    indices = torch.randint(0, 128, (3, 64), generator=generator, dtype=torch.int32)
    extra = torch.randint(0, 64, (3, 64), generator=generator, dtype=torch.int32)
    indices[0, 5] = 128  # past the cache: FlashMLA would read outside it
    extra[2, 7] = -3
    impl = flashmla.FlashMLASparseDecodeImpl(64, 448, 64)
    errors.error_flag("cpu").zero_()
    out, lse = impl.forward_v4(q, kv, indices, SCALE, kv_format="fp8_ds_mla_v4", extra_kv=window,
                               extra_indices=extra, extra_kv_format="fp8_ds_mla_v4")
    assert bool(torch.isnan(out[0]).all() and torch.isnan(lse[0]).all())
    assert bool(torch.isnan(out[2]).all() and torch.isnan(lse[2]).all())
    assert bool(torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all())
    assert int(errors.error_flag("cpu")) & errors.SPARSE_INDEX
    errors.error_flag("cpu").zero_()
    with override("H200"), pytest.raises(ValueError, match="extra_indices hold"):  # with the data checks
        mm.ops.mla_sparse_decode_v4(q, kv, indices.clamp(0, 127), SCALE, extra_kv_cache=window,
                                    extra_indices=extra, backend="FLASHMLA")


def test_v4_decode_zero_tokens(fake_flash_mla):
    kv = cf.FP8_DS_MLA_V4.allocate(2, 64)
    with override("H200"):
        out, lse = mm.ops.mla_sparse_decode_v4(torch.zeros(0, 64, WIDTH, dtype=torch.bfloat16), kv,
                                               torch.zeros(0, 64, dtype=torch.int32), SCALE, backend="FLASHMLA",
                                               return_lse=True)
    assert out.shape == (0, 64, WIDTH) and lse.shape == (0, 64)
    assert not _v4_calls(fake_flash_mla)


def test_v41_decode_runs_the_current_kernels_on_sm100_only(fake_flash_mla):
    generator = torch.Generator().manual_seed(7)
    kv = _cache(cf.FP8_DS_MLA_V41, 4, 64, generator)
    window = _cache(cf.FP4_DS_MLA_V41, 2, 64, generator)  # the FP4 second segment beside V4.1
    q = torch.randn(3, 128, WIDTH, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 256, (3, 128), generator=generator, dtype=torch.int32)
    extra = torch.randint(-1, 128, (3, 64), generator=generator, dtype=torch.int32)
    keywords = dict(attn_sink=torch.randn(128, generator=generator), extra_kv_cache=window, extra_indices=extra,
                    topk_length=torch.tensor([128, 1, 0], dtype=torch.int32))
    want, want_lse = _decode("REFERENCE", q, kv, indices, **keywords)
    with override("B200"):
        assert registry.select_sparse_backend(
            "sparse_decode", MLADims(128, kv_lora_rank=448, qk_rope_head_dim=64), torch.bfloat16, torch.uint8,
            192, kv_format="fp8_ds_mla_v41", extra_kv_format="fp4_ds_mla_v41", with_sink=True).name == "FLASHMLA"
        out, lse = _decode("FLASHMLA", q, kv, indices, **keywords)
    assert _rel(out, want) < 1e-2
    _check_lse(lse, want_lse)
    call = _v4_calls(fake_flash_mla)[-1]
    assert not call["use_legacy"] and call["kv_format"] is None
    with override("H200"):
        config = registry.sparse_config(MLADims(128, kv_lora_rank=448, qk_rope_head_dim=64), torch.bfloat16,
                                        torch.uint8, 192, kv_format="fp8_ds_mla_v41", extra_kv_format="fp4_ds_mla_v41")
        reasons = registry.default_registry.reasons("sparse_decode", "FLASHMLA", mm.current_platform(), config)
        assert any("sm_100 only" in r and "sm_90" in r and "fp8_ds_mla_v41 and fp4_ds_mla_v41" in r for r in reasons)
        # unforced, the V4.1 call falls past FLASHMLA on sm_90 (to TRITON, a GPU launch)
        assert registry.select_sparse_backend(
            "sparse_decode", MLADims(128, kv_lora_rank=448, qk_rope_head_dim=64), torch.bfloat16, torch.uint8,
            192, kv_format="fp8_ds_mla_v41", extra_kv_format="fp4_ds_mla_v41", with_sink=True).name == "TRITON"
        assert len(_v4_calls(fake_flash_mla)) == 1


def _v4_config(heads=128, kv_format="fp8_ds_mla_v4", extra_kv_format="fp8_ds_mla_v4", kv_dtype=torch.uint8,
               topk=640):
    return registry.sparse_config(MLADims(heads, kv_lora_rank=448, qk_rope_head_dim=64), torch.bfloat16, kv_dtype,
                                  topk, kv_format=kv_format, extra_kv_format=extra_kv_format, with_sink=True,
                                  with_lengths=True)


def _reasons(phase, config, spec="H200"):
    with override(spec):
        return registry.default_registry.reasons(phase, "FLASHMLA", mm.current_platform(), config)


def test_v4_selection_and_reasons(fake_flash_mla):
    with override("H200"):
        chosen = registry.default_registry.select("sparse_decode", _v4_config())
        assert chosen.name == "FLASHMLA"  # first on sm_90 for the V4 decode
        assert registry.default_registry.select("sparse_prefill", _v4_config(
            kv_format="rows", extra_kv_format=None, kv_dtype=torch.bfloat16, topk=2048)).name == "FLASHMLA"
    assert _reasons("sparse_decode", _v4_config()) == []
    assert _reasons("sparse_decode", _v4_config(heads=64), "B200") == []
    reasons = _reasons("sparse_decode", _v4_config(heads=32))
    assert any("num_heads 32" in r and "64 or 128" in r for r in reasons)
    reasons = _reasons("sparse_decode", _v4_config(kv_format="fp8_ds_mla_v4", extra_kv_format="fp8_ds_mla_v41"),
                       "B200")
    assert any("second segment in fp8_ds_mla_v41 beside a fp8_ds_mla_v4" in r for r in reasons)
    reasons = _reasons("sparse_decode", _v4_config(kv_format="fp4_ds_mla_v41", extra_kv_format=None), "B200")
    assert any("fp4_ds_mla_v41 main cache" in r for r in reasons)
    reasons = _reasons("sparse_decode", _v4_config(kv_format="rows", extra_kv_format=None,
                                                   kv_dtype=torch.bfloat16))
    assert any("over rows is not implemented by FLASHMLA" in r for r in reasons)
    reasons = _reasons("sparse_decode", _v4_config(), "A100")
    assert any("sm_80" in r for r in reasons)
    # prefill: bf16 rows, one kv
    prefill = _v4_config(kv_format="rows", extra_kv_format="rows", kv_dtype=torch.bfloat16, topk=2048)
    assert any("second KV segment" in r and "flash_mla_sparse_fwd" in r for r in _reasons("sparse_prefill", prefill))
    prefill = _v4_config(kv_format="rows", extra_kv_format=None, kv_dtype=torch.float32, topk=2048)
    assert any("kv rows of float32" in r for r in _reasons("sparse_prefill", prefill))
    prefill = _v4_config(heads=16, kv_format="rows", extra_kv_format=None, kv_dtype=torch.bfloat16, topk=2048)
    assert any("num_heads 16" in r for r in _reasons("sparse_prefill", prefill))
    info = flashmla.FlashMLASparseDecodeBackend.info()["v4_formats"]
    assert info == ["fp8_ds_mla_v4", "fp8_ds_mla_v41", "fp4_ds_mla_v41"]
    assert flashmla.FlashMLASparsePrefillBackend.info()["v4_formats"] == ["rows"]


@pytest.mark.parametrize("heads,topk", [(64, 256), (128, 200)])
def test_v4_prefill_matches_reference_with_sink_and_lengths(fake_flash_mla, heads, topk):
    case = v4_prefill_inputs(heads, topk, 300, seed=heads + topk)  # indices outside [0, 300): no token
    q, kv, indices, lengths, sink = (case[k] for k in ("q", "kv", "indices", "topk_length", "attn_sink"))
    for topk_length, attn_sink in ((None, None), (lengths, sink)):
        keywords = dict(topk_length=topk_length, attn_sink=attn_sink, return_lse=True)
        want, want_lse = mm.ops.mla_sparse_prefill_v4(q.double(), kv.double(), indices, SCALE, backend="REFERENCE",
                                                      **keywords)
        with override("H200"):
            out, lse = mm.ops.mla_sparse_prefill_v4(q, kv, indices, SCALE, backend="FLASHMLA", **keywords)
        assert _rel(out, want) < 1e-2
        _check_lse(lse, want_lse)
        assert bool((lse[1] == -math.inf).all()) and not bool(out[1].any())
        call = [c for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_sparse_fwd"][-1]
        assert call["width"] == WIDTH and call["topk"] == -(-topk // 128) * 128 and call["use_legacy"]
        assert call["attn_sink"] == (attn_sink is not None)
        if topk_length is None:
            assert call["topk_length"] is None
        else:  # passed (the kernel stops at each token's length) beside the folded lists
            assert torch.equal(call["topk_length"], topk_length)


def test_v4_prefill_over_no_rows_and_the_second_segment(fake_flash_mla):
    q = torch.randn(3, 64, WIDTH).to(torch.bfloat16)
    indices = torch.zeros(3, 128, dtype=torch.int32)
    with override("H200"):
        out, lse = mm.ops.mla_sparse_prefill_v4(q, torch.zeros(0, WIDTH, dtype=torch.bfloat16), indices, SCALE,
                                                backend="FLASHMLA", return_lse=True)
        assert not bool(out.any()) and bool((lse == -math.inf).all())
        with pytest.raises(mm.NoBackendError, match="second KV segment"):
            mm.ops.mla_sparse_prefill_v4(q, torch.zeros(8, WIDTH, dtype=torch.bfloat16), indices, SCALE,
                                         extra_kv=torch.zeros(8, WIDTH, dtype=torch.bfloat16),
                                         extra_indices=indices, backend="FLASHMLA")
        # unforced, a prefill with a second segment goes past FLASHMLA (to TRITON, a GPU launch)
        assert registry.select_sparse_backend(
            "sparse_prefill", MLADims(64, kv_lora_rank=448, qk_rope_head_dim=64), torch.bfloat16, torch.bfloat16,
            128, kv_format="rows", extra_kv_format="rows", with_sink=False).name == "TRITON"
    assert not [c for c in fake_flash_mla.CALLS if c["function"] == "flash_mla_sparse_fwd"]
    impl = flashmla.FlashMLASparsePrefillImpl(64, 448, 64)
    with pytest.raises(ValueError, match="extra_kv: FlashMLA's sparse prefill"):
        impl.forward_v4(q, torch.ones(8, WIDTH, dtype=torch.bfloat16), indices, SCALE,
                        extra_kv=torch.ones(8, WIDTH, dtype=torch.bfloat16), extra_indices=indices)


def test_the_fake_refuses_what_flashmla_refuses(fake_flash_mla):
    """The stand-in holds FlashMLA's rules, so that the adapter's calls are checked against them."""
    kv = cf.FP8_DS_MLA_V4.allocate(2, 64)
    q = torch.zeros(1, 1, 64, WIDTH, dtype=torch.bfloat16)
    indices = torch.zeros(1, 1, 64, dtype=torch.int32)
    call = fake_flash_mla.flash_mla_with_kvcache
    sched = lambda: fake_flash_mla.get_mla_metadata()[0]  # noqa: E731
    base = dict(block_table=None, cache_seqlens=None, head_dim_v=WIDTH, is_fp8_kvcache=True, use_legacy=True)
    with pytest.raises(AssertionError, match="mod B_TOPK"):
        call(q, kv.unsqueeze(2), tile_scheduler_metadata=sched(), indices=indices[..., :40], **base)
    fp4 = cf.FP4_DS_MLA_V41.allocate(1, 64)
    with pytest.raises(AssertionError, match="only supported as extra_kv"):
        call(q, fp4.unsqueeze(2), tile_scheduler_metadata=sched(), indices=indices, **dict(base, use_legacy=False))
    with pytest.raises(AssertionError, match="format of kv"):
        call(q, kv.unsqueeze(2), tile_scheduler_metadata=sched(), indices=indices, extra_k_cache=fp4.unsqueeze(2),
             extra_indices_in_kvcache=indices, **base)
    with pytest.raises(IndexError):
        call(q, kv.unsqueeze(2), tile_scheduler_metadata=sched(), indices=indices - 2, **base)
    shared = sched()
    call(q, kv.unsqueeze(2), tile_scheduler_metadata=shared, indices=indices,
         topk_length=torch.tensor([64], dtype=torch.int32), **base)
    with pytest.raises(AssertionError, match="stale"):
        call(q, kv.unsqueeze(2), tile_scheduler_metadata=shared, indices=indices,
             topk_length=torch.tensor([3], dtype=torch.int32), **base)


def test_info_selects_flashmla_for_both_v4_phases_where_its_wheel_is_installed(fake_flash_mla):
    """`mla-multi info --as H200` with FlashMLA installed: its V4 rows select FLASHMLA, with no reason."""
    from mla_multi import cli

    info = cli.collect_info("H200")
    for label in ("sparse_decode_v4", "sparse_prefill_v4"):
        data = info["phases"][label]
        assert data["selected"] == "FLASHMLA", data["selected"]
        rows = {row["name"]: row for row in data["backends"]}
        assert rows["FLASHMLA"]["reasons"] == []


def test_empty_index_lists_give_zeros_and_minus_inf(fake_flash_mla):
    """Index lists of no entry reach FlashMLA as one tile of -1 (it takes no empty list)."""
    kv = _cache(cf.FP8_DS_MLA_V4, 1, 64, torch.Generator().manual_seed(9))
    q = torch.ones(2, 64, WIDTH, dtype=torch.bfloat16)
    none = torch.zeros(2, 0, dtype=torch.int32)
    with override("H200"):
        out, lse = mm.ops.mla_sparse_decode_v4(q, kv, none, SCALE, extra_kv_cache=kv, extra_indices=none,
                                               backend="FLASHMLA", return_lse=True)
        assert not bool(out.any()) and bool((lse == -math.inf).all())
        call = _v4_calls(fake_flash_mla)[-1]
        assert (call["topk"], call["extra_topk"]) == (64, 64)
        out, lse = mm.ops.mla_sparse_prefill_v4(q, torch.ones(8, WIDTH, dtype=torch.bfloat16), none, SCALE,
                                                topk_length=torch.zeros(2, dtype=torch.int32), backend="FLASHMLA",
                                                return_lse=True)
        assert not bool(out.any()) and bool((lse == -math.inf).all())


def test_a_schedule_made_inside_a_graph_capture_is_not_kept(fake_flash_mla, monkeypatch):
    """A capture's schedule is written only when its graph replays: it serves that call alone, and the first
    call outside a capture makes the one every later call (captures included) reuses."""
    call = flashmla._V4DecodeCall(0, 64, 64, 64, torch.device("cuda"), has_length=False, has_extra_length=False,
                                  legacy=True)
    capturing = {"now": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    first, second = call.schedule(fake_flash_mla), call.schedule(fake_flash_mla)
    assert first is not second and call.schedule_meta is None
    capturing["now"] = False
    kept = call.schedule(fake_flash_mla)
    assert call.schedule_meta is kept and call.schedule(fake_flash_mla) is kept
    capturing["now"] = True
    assert call.schedule(fake_flash_mla) is kept


def test_a_schedule_made_by_the_op_inside_a_graph_capture_is_not_kept():
    """FlashMLA's op called directly: the schedule it makes in a captured call serves that capture alone; the
    first call outside a capture makes the one every later call is given."""
    call = flashmla._V4DecodeCall(0, 64, 64, 64, torch.device("cuda"), has_length=False, has_extra_length=False,
                                  legacy=True)
    given = []

    def op(q, kv, listed, topk_length, sink, metadata, num_splits, *rest):
        given.append(metadata)
        if metadata is None:
            metadata, num_splits = torch.zeros(4, 8, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        return q, kv, metadata, num_splits

    arguments = (torch.zeros(1), torch.ones(1), None, None, None, None, 512, 0.1, "V4")
    call.call_op(op, True, *arguments)
    call.call_op(op, True, *arguments)
    assert given == [None, None] and call.schedule_made is None
    out, lse = call.call_op(op, False, *arguments)
    assert given[-1] is None and call.schedule_made is not None and torch.equal(out, torch.zeros(1))
    kept = call.schedule_made[0]
    call.call_op(op, True, *arguments)
    call.call_op(op, False, *arguments)
    assert given[-2:] == [kept, kept] and call.schedule_made[0] is kept


def test_without_flashmla_s_op_the_interface_is_called(fake_flash_mla, monkeypatch):
    """A flash_mla whose legacy op cannot be read, or takes other arguments, is called through its interface
    (`flash_mla_with_kvcache`), with the same results."""
    generator = torch.Generator().manual_seed(3)
    kv = _cache(cf.FP8_DS_MLA_V4, 4, 64, generator)
    window = _cache(cf.FP8_DS_MLA_V4, 2, 64, generator)
    q = torch.randn(2, 64, WIDTH, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-1, 256, (2, 128), generator=generator, dtype=torch.int32)
    keywords = dict(extra_kv_cache=window, extra_indices=torch.randint(-1, 128, (2, 64), generator=generator,
                                                                      dtype=torch.int32))
    with override("H200"):
        want, _ = _decode("REFERENCE", q, kv, indices, **keywords)
        assert flashmla.legacy_sparse_decode_op(fake_flash_mla) is not None
        other = type(fake_flash_mla._loader._LEGACY.sparse_decode_fwd)()
        other.default._schema = torch._C.parse_schema(
            fake_flash_mla._loader.SPARSE_DECODE_SCHEMA.replace("str? kv_format=None", "bool enable_batch_invariant"))
        for patch in ({"sparse_decode_fwd": other}, None):
            if patch is None:
                monkeypatch.delattr(fake_flash_mla, "_loader")
            else:
                monkeypatch.setattr(fake_flash_mla._loader, "_LEGACY", type(fake_flash_mla._loader._LEGACY)(**patch))
            flashmla.clear_caches()
            mm.ops._PLANS.clear()  # plans bound with the op: bound again
            assert flashmla.legacy_sparse_decode_op(fake_flash_mla) is None
            fake_flash_mla.CALLS.clear()
            out, _ = _decode("FLASHMLA", q, kv, indices, **keywords)
            assert _rel(out, want) < 1e-2
            functions = [c["function"] for c in fake_flash_mla.CALLS]
            assert "flash_mla_with_kvcache" in functions and "sparse_decode_fwd" not in functions
