"""The sm_90 warp-specialised decode kernels (`mla_decode_wgmma`, Gluon) against float64 references.

* CPU: where the configurations come from (impersonated Hopper and other
  devices), the reasons when the kernel cannot run, and the error when a
  warpgroup configuration is forced where it cannot run.  Its ahead-of-time
  compilation for sm_90 is part of `mla-multi compile-check` (test_compile_check).
* GPU (marked ``gpu``, sm_90 with a Gluon-capable Triton): bf16 and FP8 caches,
  every row bucket (16, 32, 64 rows), heads 1..128, block sizes 1/16/64/128,
  sequence lengths 0, 1, 17 and long mixed in one batch, one split (direct
  output) and several, multi-token decode, NaN-poisoned outputs, workspaces and
  unread cache rows, bad index data, CUDA-graph replay with new lengths.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels_decode import _e4m3_query, _errors, _make_case, _run_decode, check_multi_token_gpu

from mla_multi.kernels.launch_config import DecodeLaunchConfig, all_decode_configs, decode_config, wgmma_decode_reason
from mla_multi.platforms import SPECS


def _gluon_ok() -> bool:
    from mla_multi.kernels.mla_decode_wgmma import gluon_available

    return gluon_available()[0]


WS64 = DecodeLaunchConfig(64, 64, 4, 2, kernel="wgmma_ws")
WS32 = DecodeLaunchConfig(32, 64, 4, 2, kernel="wgmma_ws")
WS16 = DecodeLaunchConfig(16, 64, 4, 2, kernel="wgmma_ws")
RM64 = DecodeLaunchConfig(64, 64, 4, 2, kernel="wgmma_rm")
# 16-bit tiles by TMA where the cache allows it (whole tiles inside a page), cp.async otherwise
RM64T = DecodeLaunchConfig(64, 64, 4, 2, kernel="wgmma_rm", tma=True)
WS32T = DecodeLaunchConfig(32, 64, 4, 2, kernel="wgmma_ws", tma=True)
RM64QT = DecodeLaunchConfig(64, 64, 4, 1, kernel="wgmma_rm", raw_stages=2, tma=True)
WS16PT = DecodeLaunchConfig(16, 64, 4, 0, kernel="wgmma_ws", raw_stages=4, tma=True)
# FP8 QK products from raw FP8 stages (the default FP8 configurations)
WS16Q = DecodeLaunchConfig(16, 64, 4, 2, kernel="wgmma_ws", raw_stages=2)
RM64Q = DecodeLaunchConfig(64, 64, 4, 1, kernel="wgmma_rm", raw_stages=2)
# QK and P V on FP8 tensor cores from four raw stages, no float16 stages (the default up to 16 rows)
WS16P = DecodeLaunchConfig(16, 64, 4, 0, kernel="wgmma_ws", raw_stages=4)


# ---------------------------------------------------------------------------
# CPU: selection and reasons
# ---------------------------------------------------------------------------


def test_benchmark_parses_every_sm90_config_name():
    """`mla-multi bench decode --configs` takes back the name of every configuration the sm_90 tables can run."""
    from mla_multi.benchmarks.decode import parse_config

    for config in all_decode_configs(SPECS["H100"]):
        parsed = parse_config(config.name)
        assert (parsed.name, parsed.kernel, parsed.warp_specialised, parsed.raw_stages, parsed.tma) == (
            config.name, config.kernel, config.warp_specialised, config.raw_stages, config.tma
        )
    with pytest.raises(ValueError, match="h64n64w4s2xx"):
        parse_config("h64n64w4s2xx")
    # the Triton kernel's tokens as M (the AMD tables' wide tiles), and only the Triton kernel's
    assert parse_config("h32n64w4s2tm") == DecodeLaunchConfig(32, 64, 4, 2, tokens_as_m=True)
    with pytest.raises(ValueError, match="tokens_as_m is an option of the Triton kernel, not of kernel 'wgmma_rm'"):
        parse_config("h64n64w4s2tmrm")


def test_tma_needs_a_16_bit_cache_of_whole_tile_pages_with_aligned_evenly_spaced_rows():
    """`tma_cache_reason` says why a cache's tiles cannot go by TMA (the loader then takes cp.async), and
    the descriptors address the latent and rotary columns of the cache viewed as [blocks x page, 576]."""
    if not _gluon_ok():
        pytest.skip("this Triton has no Gluon")
    from mla_multi.kernels import mla_decode_wgmma as wg

    cache = torch.zeros(10, 64, 576, dtype=torch.bfloat16)
    if wg._TensorDescriptor is None:
        assert "TensorDescriptor" in wg.tma_cache_reason(cache, 64, 512)
        return
    assert wg.tma_cache_reason(cache, 64, 512) == ""
    assert wg.tma_cache_reason(torch.zeros(4, 128, 576, dtype=torch.bfloat16), 64, 512) == ""
    # rows wider than 576 (a slice of a wider cache) are still evenly spaced
    wide = torch.zeros(10, 64, 1152, dtype=torch.bfloat16)[:, :, :576]
    assert wg.tma_cache_reason(wide, 64, 512) == "" and wg._tma_cache_descriptors(wide, 64, 512)[0].strides == [1152, 1]
    kv, pe = wg._tma_cache_descriptors(cache, 64, 512)
    assert (kv.shape, kv.strides, kv.block_shape) == ([640, 512], [576, 1], [64, 512])
    assert (pe.shape, pe.strides, pe.block_shape) == ([640, 64], [576, 1], [64, 64])
    assert pe.base.data_ptr() == cache.data_ptr() + 512 * 2 and kv.base.data_ptr() == cache.data_ptr()
    assert wg._tma_cache_descriptors(cache, 64, 512)[0] is kv  # built once per cache
    assert kv.__mangle__() == wg.tma_descriptor_type(64, 512)  # what the compile check compiles
    # FP8 bytes into the raw stages: the rotary part's 64-byte rows take the 64-byte swizzle
    fp8 = torch.zeros(10, 64, 576, dtype=torch.float8_e4m3fn)
    assert wg.tma_cache_reason(fp8, 64, 512) == ""
    kv8, pe8 = wg._tma_cache_descriptors(fp8, 64, 512)
    assert (kv8.layout.swizzle_byte_width, pe8.layout.swizzle_byte_width) == (128, 64)
    assert pe8.base.data_ptr() == fp8.data_ptr() + 512 and pe8.__mangle__() == wg.tma_descriptor_type(64, 64, "fp8e4nv")
    for bad, expected in (
        (torch.zeros(10, 16, 576, dtype=torch.bfloat16), "block_size 16 is not a multiple of the 64-token tile"),
        (torch.zeros(10, 64, 576, dtype=torch.float8_e4m3fnuz), "float8_e4m3fnuz cache is read by cp.async"),
        (torch.zeros(10, 64, 576, dtype=torch.float32), "float32 cache is read by cp.async"),
        (torch.zeros(10, 2, 64, 576, dtype=torch.bfloat16)[:, 0], "not rows evenly spaced"),
        (torch.zeros(10, 64, 580, dtype=torch.bfloat16)[:, :, :576], "not 16-byte aligned"),
        (torch.zeros(10 * 64 * 576 + 4, dtype=torch.bfloat16)[4:].view(10, 64, 576), "not 16-byte aligned"),
    ):
        assert expected in wg.tma_cache_reason(bad, 64, 512), (bad.shape, bad.stride())
        assert wg._tma_cache_descriptors(bad, 64, 512) is None


def test_config_name_marks_the_warpgroup_kernel():
    assert RM64T.name == "h64n64w4s2rmt" and WS32T.name == "h32n64w4s2wst"
    assert WS64.name == "h64n64w4s2ws"
    assert RM64.name == "h64n64w4s2rm"
    assert WS16Q.name == "h16n64w4s2wsf2" and RM64Q.name == "h64n64w4s1rmf2" and WS16P.name == "h16n64w4s0wsf4"
    assert DecodeLaunchConfig(64, 64, 8, 2).name == "h64n64w8s2"


def test_an_unknown_kernel_is_an_error_naming_the_accepted_ones():
    """The single-stream warpgroup kernel is gone: asking for it, by its old value or its old name suffix
    (wg), is an error that names the kernels there are."""
    from mla_multi.benchmarks.decode import parse_config

    removed = "wgmma"
    with pytest.raises(ValueError, match=rf"kernel {removed!r}; accepted: 'triton', 'wgmma_ws', 'wgmma_rm'"):
        DecodeLaunchConfig(64, 64, 8, 2, kernel=removed)
    with pytest.raises(ValueError, match="h64n64w8s2wg"):
        parse_config("h64n64w8s2wg")


@pytest.mark.parametrize("spec", ["H100", "H200"])
def test_hopper_takes_the_warpgroup_kernel_past_16_rows(spec):
    platform = SPECS[spec]
    if not _gluon_ok():
        assert wgmma_decode_reason(platform, torch.bfloat16)
        assert all(c.kernel == "triton" for c in all_decode_configs(platform))
        return
    assert wgmma_decode_reason(platform, torch.bfloat16) == ""
    for heads, q_len, kernel, block_h in (
        (32, 1, "wgmma_ws", 32), (16, 2, "wgmma_ws", 32), (64, 1, "wgmma_rm", 64), (128, 1, "wgmma_rm", 64),
        (128, 4, "wgmma_rm", 64),
    ):
        config = decode_config(platform, heads, q_len, torch.bfloat16)
        assert (config.kernel, config.block_h) == (kernel, block_h), (heads, q_len, config)
        assert config.tma, config  # 16-bit tiles by TMA where the cache allows it
    # FP8 (e4m3fn): the warp-specialised kernels at every row count (tokens as M up to 16 rows), with
    # QK on FP8 tensor cores from raw stages (up to 16 rows P V too, from four raw stages and no float16
    # stage), or float16 products (fp8_qk=False)
    for heads, kernel, block_h, raw, stages in (
        (1, "wgmma_ws", 16, 4, 0), (16, "wgmma_ws", 16, 4, 0), (32, "wgmma_rm", 64, 2, 1), (128, "wgmma_rm", 64, 2, 1)
    ):
        config = decode_config(platform, heads, 1, torch.float8_e4m3fn)
        assert (config.kernel, config.block_h, config.raw_stages, config.num_stages, config.tma) == (
            kernel, block_h, raw, stages, heads > 16
        ), (heads, config)
        config = decode_config(platform, heads, 1, torch.float8_e4m3fn, fp8_qk=False)
        assert (config.kernel, config.block_h, config.raw_stages) == (kernel, block_h, 0), (heads, config)
    # 16-bit caches up to 16 rows: the Triton kernel
    assert decode_config(platform, 16, 1, torch.bfloat16).kernel == "triton"


def test_fp8_qk_follows_the_environment(monkeypatch):
    """MLA_MULTI_FP8_QK=0 turns the default FP8 configurations back to float16 products; a bad value is an error."""
    platform = SPECS["H200"]
    if wgmma_decode_reason(platform, torch.float8_e4m3fn):
        pytest.skip(wgmma_decode_reason(platform, torch.float8_e4m3fn))
    monkeypatch.setenv("MLA_MULTI_FP8_QK", "0")
    assert decode_config(platform, 128, 1, torch.float8_e4m3fn) == decode_config(
        platform, 128, 1, torch.float8_e4m3fn, fp8_qk=False
    )
    assert decode_config(platform, 128, 1, torch.float8_e4m3fn).raw_stages == 0
    monkeypatch.setenv("MLA_MULTI_FP8_QK", "1")
    assert decode_config(platform, 16, 1, torch.float8_e4m3fn) == WS16P
    assert decode_config(platform, 128, 1, torch.float8_e4m3fn) == RM64QT
    # 16-bit caches never take raw stages
    assert decode_config(platform, 128, 1, torch.bfloat16).raw_stages == 0
    from mla_multi.envs import EnvironmentValueError

    monkeypatch.setenv("MLA_MULTI_FP8_QK", "maybe")
    with pytest.raises(EnvironmentValueError, match="MLA_MULTI_FP8_QK='maybe'"):
        decode_config(platform, 128, 1, torch.float8_e4m3fn)


def test_raw_fp8_stages_need_an_e4m3fn_cache():
    """Forcing a raw-stage configuration on a 16-bit cache is an error naming what it needs."""
    platform = SPECS["H100"]
    if wgmma_decode_reason(platform, torch.bfloat16):
        pytest.skip(wgmma_decode_reason(platform, torch.bfloat16))
    tensors = _make_case(2, 16, 1, 512, 64, 16, [20, 5], torch.bfloat16, torch.bfloat16, "cpu", 0)
    with pytest.raises(ValueError, match=r"h64n64w4s1rmf2.*raw FP8 stages.*float8_e4m3fn.*torch.bfloat16"):
        _run_decode(tensors, 576**-0.5, 1, config=RM64Q, platform=platform)


@pytest.mark.parametrize("spec", ["H100", "A100", "B200", "MI300X", "MI355X", "CPU"])
def test_e4m3fnuz_and_other_devices_keep_the_triton_kernel(spec):
    platform = SPECS[spec]
    for heads in (16, 32, 128):
        assert decode_config(platform, heads, 1, torch.float8_e4m3fnuz).kernel == "triton"
    if spec != "H100":
        reason = wgmma_decode_reason(platform, torch.bfloat16)
        assert "sm_90" in reason and platform.arch in reason
        assert all(c.kernel == "triton" for c in all_decode_configs(platform))
    assert "float8_e4m3fnuz" in wgmma_decode_reason(SPECS["H100"], torch.float8_e4m3fnuz) or not _gluon_ok()


def test_other_latent_dims_keep_the_triton_kernel():
    platform = SPECS["H200"]
    assert decode_config(platform, 128, 1, torch.bfloat16, kv_lora_rank=256, rope_dim=64).kernel == "triton"
    assert decode_config(platform, 128, 1, torch.bfloat16, kv_lora_rank=512, rope_dim=32).kernel == "triton"
    assert "kv_lora_rank=256" in wgmma_decode_reason(platform, torch.bfloat16, 256, 64)


def test_forcing_the_warpgroup_kernel_where_it_cannot_run_is_an_error():
    tensors = _make_case(2, 16, 1, 512, 64, 16, [20, 5], torch.bfloat16, torch.bfloat16, "cpu", 0)
    for config in (RM64, WS32):
        with pytest.raises(ValueError, match=rf"{config.name}.*cannot run here.*sm_90"):
            _run_decode(tensors, 576**-0.5, 1, config=config, platform=SPECS["A100"])


def _unaligned_fp8_copy(cache: torch.Tensor) -> torch.Tensor:
    """`cache` (FP8) copied into a view whose data starts one byte past an allocation's start."""
    storage = torch.zeros(cache.numel() + 1, dtype=torch.uint8, device=cache.device)
    view = storage[1:].view(cache.dtype).view(cache.shape)
    view.copy_(cache)
    assert view.data_ptr() % 4 == 1
    return view


def test_an_fp8_cache_off_4_byte_boundaries_keeps_the_triton_kernel():
    """The warpgroup kernels read an FP8 cache as 4-byte words: a cache view that starts off a 4-byte
    boundary takes the Triton kernel by default, and forcing a warpgroup configuration on it is an error."""
    platform = SPECS["H100"]
    if wgmma_decode_reason(platform, torch.float8_e4m3fn):
        pytest.skip(wgmma_decode_reason(platform, torch.float8_e4m3fn))
    assert decode_config(platform, 128, 1, torch.float8_e4m3fn).warpgroup
    assert not decode_config(platform, 128, 1, torch.float8_e4m3fn, warpgroup=False).warpgroup
    tensors = _make_case(2, 16, 1, 512, 64, 16, [20, 5], torch.float8_e4m3fn, torch.bfloat16, "cpu", 0)
    tensors["kv_cache"] = _unaligned_fp8_copy(tensors["kv_cache"])
    with pytest.raises(ValueError, match=r"h64n64w4s2rm.*cannot run here.*4-byte boundaries"):
        _run_decode(tensors, 576**-0.5, 1, config=RM64, platform=platform)


def _ds_mla_case(query_dtype=torch.bfloat16, width=656):
    from mla_multi.kernels.mla_decode import attn_logits_width

    batch, heads = 2, 16
    return dict(
        q_nope=torch.zeros(batch, heads, 512, dtype=query_dtype),
        q_pe=torch.zeros(batch, heads, 64, dtype=query_dtype),
        kv_cache=torch.zeros(4, 64, width, dtype=torch.uint8),
        block_table=torch.zeros(batch, 2, dtype=torch.int32),
        seq_lens=torch.tensor([5, 70], dtype=torch.int32),
        k_scale=None,
        num_kv_splits=1,
        attn_logits=torch.zeros(batch, heads, 1, attn_logits_width(512)),
        out=torch.zeros(batch, heads, 512, dtype=query_dtype),
        lse=torch.zeros(batch, heads),
    )


def _ds_mla_decode(case, platform):
    from mla_multi.kernels.mla_decode import mla_decode_fwd

    case = dict(case)
    args = [case.pop(name) for name in ("q_nope", "q_pe", "kv_cache", "block_table", "seq_lens")]
    return mla_decode_fwd(*args, 0.05, platform=platform, **case)


@pytest.mark.parametrize("spec", ["A100", "B200", "MI300X", "MI355X"])
def test_fp8_ds_mla_is_read_in_place_by_the_sm90_kernels_only(spec):
    """An fp8_ds_mla (uint8, 656-byte rows) cache: a reason naming sm_90 elsewhere, and decoding one there
    is a ValueError that says so (the sparse backends then go through the dequantised scratch)."""
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason

    reason = ds_mla_decode_reason(SPECS[spec])
    assert "sm_90" in reason
    with pytest.raises(ValueError, match="fp8_ds_mla kv_cache cannot be decoded here.*sm_90"):
        _ds_mla_decode(_ds_mla_case(), SPECS[spec])


def test_fp8_ds_mla_decode_checks_its_layout_and_query():
    from mla_multi.kernels.mla_decode import ds_mla_decode_reason

    platform = SPECS["H100"]
    if not _gluon_ok():
        pytest.skip("this Triton has no Gluon")
    assert ds_mla_decode_reason(platform) == ""
    with pytest.raises(ValueError, match=r"kv_cache has shape \(4, 64, 576\); accepted: \[num_blocks, block_size, 656\]"):
        _ds_mla_decode(_ds_mla_case(width=576), platform)
    with pytest.raises(ValueError, match="fp8_ds_mla .* with a torch.float16 query; accepted: bfloat16"):
        _ds_mla_decode(_ds_mla_case(torch.float16), platform)
    unaligned = torch.zeros(4 * 64 * 656 + 2, dtype=torch.uint8)[2:].view(4, 64, 656)
    assert "4-byte boundaries" in ds_mla_decode_reason(platform, unaligned)


def test_fp8_ds_mla_configuration_and_splits_come_from_the_shared_tables():
    """decode_config and the split heuristic know fp8_ds_mla (uint8) themselves: the FP8 table's
    register-loader configurations on sm_90 (no raw stages, 64-token tiles), and the split counts the
    measured in-place decode used (those of an e4m3fn cache)."""
    from mla_multi.heuristics import max_num_kv_splits, num_kv_splits

    platform = SPECS["H100"]
    if not _gluon_ok():
        pytest.skip("this Triton has no Gluon")
    assert wgmma_decode_reason(platform, torch.uint8) == ""
    assert "sm_90" in wgmma_decode_reason(SPECS["A100"], torch.uint8)
    for heads in (16, 32, 64, 128):
        config = decode_config(platform, heads, 1, torch.uint8)
        assert config == decode_config(platform, heads, 1, torch.float8_e4m3fn, fp8_qk=False)
        assert config.warp_specialised and config.raw_stages == 0 and config.num_stages > 0 and config.block_n == 64
    for tokens, heads, topk in ((1, 128, 2048), (32, 128, 2048), (128, 128, 2048), (64, 64, 2048), (4096, 128, 256)):
        limit = max_num_kv_splits(topk, platform)
        assert num_kv_splits(platform, tokens, heads, topk, limit, kv_cache_dtype=torch.uint8) == num_kv_splits(
            platform, tokens, heads, topk, limit, kv_cache_dtype=torch.float8_e4m3fn)


def test_compile_check_builds_the_fp8_ds_mla_loader_for_sm90_only():
    from mla_multi.kernels.mla_decode import compile_specs

    if not _gluon_ok():
        pytest.skip("this Triton has no Gluon")
    names = [spec.name for spec in compile_specs(SPECS["H100"]) if "fp8_ds_mla" in spec.name]
    assert any("rm" in name and "page=1," in name for name in names)
    assert any("ws" in name and "page=1," in name for name in names)
    for spec in ("A100", "B200", "MI300X", "MI355X"):
        assert not [s.name for s in compile_specs(SPECS[spec]) if "fp8_ds_mla" in s.name], spec


# ---------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------


def _on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and _gluon_ok()


requires_hopper = pytest.mark.skipif(not _on_hopper(), reason="needs an sm_90 GPU and a Triton with Gluon")


def _config_for(heads: int, q_len: int, kernel: str) -> DecodeLaunchConfig:
    rows = heads * q_len
    if kernel == "wgmma_rm":
        return RM64
    if kernel == "wgmma_rm_tma":
        return RM64T
    if kernel == "wgmma_ws_tma":
        return WS32T
    assert kernel == "wgmma_ws", kernel
    return WS16 if rows <= 16 else WS32 if rows <= 32 else WS64


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "kernel,kv",
    [
        ("wgmma_ws", "bf16"), ("wgmma_ws", "fp8"), ("wgmma_rm", "bf16"), ("wgmma_rm", "fp8"),
        ("wgmma_rm_tma", "bf16"), ("wgmma_ws_tma", "bf16"), ("wgmma_rm_tma", "fp8"),
    ],
)
@pytest.mark.parametrize("block_size", [1, 16, 64, 128])
@pytest.mark.parametrize("heads", [1, 16, 32, 64, 128])
def test_wgmma_decode_gpu(kernel, kv, heads, block_size):
    from mla_multi.heuristics import max_num_kv_splits, num_kv_splits
    from mla_multi.platforms import current_platform

    seq_lens = [0, 1, 17, 4096, 20000]
    cache_dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    tensors = _make_case(5, heads, 1, 512, 64, block_size, seq_lens, cache_dtype, torch.bfloat16, "cuda", heads)
    scale = 576**-0.5
    platform = current_platform()
    reserved = max_num_kv_splits(20000, platform)
    config = _config_for(heads, 1, kernel)
    for splits in (1, num_kv_splits(platform, 5, heads, 20000, reserved, kv_cache_dtype=cache_dtype), 7):
        out, lse = _run_decode(tensors, scale, splits, max_splits=max(reserved, splits), config=config)
        torch.cuda.synchronize()
        result = _errors(tensors, out, lse, scale)
        assert not result["nan"], (splits, result)
        assert result["inf_pattern_ok"] and result["empty_rows_zero"], (splits, result)
        # e4m3 converts to float16 exactly and the query's power-of-two scaling
        # is exact: the FP8 path has the bf16 bound
        assert result["rel_err"] <= 1e-2, (splits, result)
        assert result["lse_err"] <= 2e-2, (splits, result)


# The FP8 QK path against float64 (the dequantised cache): with the query it computes with (`_e4m3_query`)
# the bf16 bounds; with the query as given, the bounds the e4m3 query costs (measured on an H200 with these
# normal inputs: output relative error 6.6e-3 - 2.6e-2, LSE absolute error 0.017 - 0.077)
FP8_QK_REL_ERR = 4e-2
FP8_QK_LSE_ERR = 0.15
# FP8 P V (P rounded to e4m3 after scaling by 2^8) against float64 with the e4m3 query: P's rounding is the
# added error (measured on an H200: 1.0e-2 - 1.7e-2; the LSE comes from the unrounded P and keeps its bound)
FP8_PV_REL_ERR = 2.5e-2


def _emulated_rel_err(config) -> float:
    """The output bound against float64 with the query `config` computes with."""
    return FP8_PV_REL_ERR if config.num_stages == 0 else 1e-2


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "config", [WS16Q, RM64Q, WS16P, RM64QT, WS16PT], ids=["wgmma_ws", "wgmma_rm", "wgmma_ws_pv", "rm_tma", "ws_pv_tma"]
)
@pytest.mark.parametrize("block_size", [1, 16, 64, 128])
@pytest.mark.parametrize("heads", [1, 16, 32, 128])
def test_fp8_qk_decode_gpu(config, heads, block_size):
    """QK on FP8 tensor cores from raw FP8 stages: every length class, one / heuristic / 7 splits."""
    from mla_multi.heuristics import max_num_kv_splits, num_kv_splits
    from mla_multi.platforms import current_platform

    tensors = _make_case(
        5, heads, 1, 512, 64, block_size, [0, 1, 17, 4096, 20000], torch.float8_e4m3fn, torch.bfloat16, "cuda",
        heads + block_size,
    )
    scale = 576**-0.5
    platform = current_platform()
    reserved = max_num_kv_splits(20000, platform)
    emulated = _e4m3_query(tensors)
    for splits in (1, num_kv_splits(platform, 5, heads, 20000, reserved, kv_cache_dtype=torch.float8_e4m3fn), 7):
        out, lse = _run_decode(tensors, scale, splits, max_splits=max(reserved, splits), config=config)
        torch.cuda.synchronize()
        result = _errors(emulated, out, lse, scale)
        assert not result["nan"], (splits, result)
        assert result["inf_pattern_ok"] and result["empty_rows_zero"], (splits, result)
        assert result["rel_err"] <= _emulated_rel_err(config) and result["lse_err"] <= 2e-2, (splits, result)
        result = _errors(tensors, out, lse, scale)
        assert result["rel_err"] <= FP8_QK_REL_ERR and result["lse_err"] <= FP8_QK_LSE_ERR, (splits, result)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "config", [WS16Q, RM64Q, WS16P, RM64QT, WS16PT], ids=["wgmma_ws", "wgmma_rm", "wgmma_ws_pv", "rm_tma", "ws_pv_tma"]
)
@pytest.mark.parametrize("heads,q_len", [(128, 2), (128, 4), (16, 2), (8, 2), (3, 5)])
def test_fp8_qk_decode_gpu_multi_token(config, heads, q_len):
    """Speculative decode through the FP8 QK path: each query token sees its own prefix."""
    tensors = _make_case(3, heads, q_len, 512, 64, 64, [q_len, 100, 5000], torch.float8_e4m3fn, torch.bfloat16,
                         "cuda", heads * q_len)
    emulated = _e4m3_query(tensors)
    for splits in (1, 4):
        out, lse = _run_decode(tensors, 576**-0.5, splits, config=config)
        torch.cuda.synchronize()
        result = _errors(emulated, out, lse, 576**-0.5)
        assert not result["nan"] and result["inf_pattern_ok"], (splits, result)
        assert result["rel_err"] <= _emulated_rel_err(config) and result["lse_err"] <= 2e-2, (splits, result)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_decode_gpu_cache_off_4_byte_boundaries(heads, monkeypatch):
    """An FP8 cache view one byte off an allocation's start: the default selection (the Triton kernel)
    gives the float64 reference's result, as the aligned cache does through the warpgroup kernels (with
    float16 products, as the Triton kernel: MLA_MULTI_FP8_QK=0; the e4m3 query's error is larger than
    this comparison's bound)."""
    tensors = _make_case(3, heads, 1, 512, 64, 64, [0, 17, 3000], torch.float8_e4m3fn, torch.bfloat16, "cuda", 7)
    monkeypatch.setenv("MLA_MULTI_FP8_QK", "0")
    aligned, _ = _run_decode(tensors, 576**-0.5, 1)
    monkeypatch.delenv("MLA_MULTI_FP8_QK")
    tensors["kv_cache"] = _unaligned_fp8_copy(tensors["kv_cache"])
    for splits in (1, 3):
        out, lse = _run_decode(tensors, 576**-0.5, splits, max_splits=4)
        torch.cuda.synchronize()
        result = _errors(tensors, out, lse, 576**-0.5)
        assert not result["nan"] and result["rel_err"] <= 1e-2 and result["lse_err"] <= 2e-2, (splits, result)
    assert torch.allclose(out.float(), aligned.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("factor", [2.0**17, 2.0**-30], ids=["beyond-float16-max", "below-float16-min"])
@pytest.mark.parametrize(
    "kernel", ["triton", "triton-wide", "wgmma_ws", "wgmma_rm", "wgmma_ws_qk", "wgmma_rm_qk", "wgmma_ws_pv"]
)
def test_fp8_decode_gpu_query_outside_float16_range(kernel, factor):
    """FP8 caches take float16 products: a bfloat16 query far outside float16's range both ways is scaled
    by a power of two first (the softmax scale compensates: the usual scores)."""
    heads = 64
    tensors = _make_case(3, heads, 1, 512, 64, 64, [1, 700, 3000], torch.float8_e4m3fn, torch.bfloat16, "cuda", 3)
    tensors["q_nope"] = tensors["q_nope"] * factor
    tensors["q_pe"] = tensors["q_pe"] * factor
    scale = 576**-0.5 / factor
    config = {
        "triton": DecodeLaunchConfig(16, 64, 8, 2),
        # the sm_90 FP8 64-row tile where Gluon is missing
        "triton-wide": DecodeLaunchConfig(64, 32, 8, 1, disable_licm=True),
        # the e4m3 query's per-row power of two
        "wgmma_ws_qk": WS16Q,
        "wgmma_rm_qk": RM64Q,
        "wgmma_ws_pv": WS16P,
    }.get(kernel) or _config_for(heads, 1, kernel)
    reference = _e4m3_query(tensors) if config.raw_stages else tensors
    for splits in (1, 3):
        out, lse = _run_decode(tensors, scale, splits, max_splits=4, config=config)
        torch.cuda.synchronize()
        result = _errors(reference, out, lse, scale)
        assert not result["nan"], (splits, result)
        assert result["rel_err"] <= _emulated_rel_err(config) and result["lse_err"] <= 2e-2, (splits, result)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma_rm", "wgmma_rm_tma", "wgmma_ws_tma"])
@pytest.mark.parametrize("heads,q_len", [(128, 2), (128, 4), (16, 2), (16, 4), (8, 8), (3, 5)])
def test_wgmma_decode_gpu_multi_token(heads, q_len, kernel):
    check_multi_token_gpu(heads, q_len, (1, 4), seed=heads + q_len, config=_config_for(heads, q_len, kernel))


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "config",
    [WS64, RM64, WS16Q, RM64Q, WS16P, RM64T, WS32T, RM64QT, WS16PT],
    ids=[
        "wgmma_ws", "wgmma_rm", "wgmma_ws_qk", "wgmma_rm_qk", "wgmma_ws_pv", "wgmma_rm_tma", "wgmma_ws_tma",
        "rm_qk_tma", "ws_pv_tma",
    ],
)
def test_wgmma_decode_gpu_bad_indices_give_nan_rows_and_the_flag(config):
    from mla_multi import errors

    cache_dtype = torch.float8_e4m3fn if config.raw_stages else torch.bfloat16
    tensors = _make_case(3, 64, 1, 512, 64, 64, [300, 200, 100], cache_dtype, torch.bfloat16, "cuda", 7)
    tensors["block_table"][1, 2] = tensors["kv_cache"].shape[0] + 5  # past the cache
    tensors["seq_lens"][2] = 10**6  # past the block table
    try:  # start from a clear record
        errors.raise_pending_errors("cuda")
    except ValueError:
        pass
    out, lse = _run_decode(tensors, 576**-0.5, 2, config=config)
    torch.cuda.synchronize()
    assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()
    assert not torch.isnan(out[0]).any()
    bits = errors.pending_errors(torch.device("cuda"))
    assert bits & errors.BLOCK_INDEX and bits & errors.SEQ_RANGE, bits
    with pytest.raises(ValueError, match="bad index data"):
        errors.raise_pending_errors("cuda")


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize(
    "kv,config",
    [
        ("bf16", WS64), ("fp8", WS64), ("bf16", RM64), ("fp8", RM64), ("fp8", WS16Q), ("fp8", RM64Q),
        ("fp8", WS16P), ("bf16", RM64T), ("bf16", WS32T), ("fp8", RM64QT), ("fp8", WS16PT),
    ],
    ids=[
        "ws-bf16", "ws-fp8", "rm-bf16", "rm-fp8", "ws-fp8qk", "rm-fp8qk", "ws-fp8pv", "rm-tma", "ws-tma",
        "rm-fp8qk-tma", "ws-fp8pv-tma",
    ],
)
def test_wgmma_decode_cuda_graph_replay_with_new_lengths(kv, config):
    from mla_multi.kernels.mla_decode import attn_logits_width, mla_decode_fwd
    from test_kernels_decode import _reference

    heads, lora, rope, block_size, max_blocks, num_blocks, splits = 128, 512, 64, 64, 48, 600, 4
    scale = 576**-0.5
    cache_dtype = torch.bfloat16 if kv == "bf16" else torch.float8_e4m3fn
    k_scale = torch.tensor([0.02], device="cuda") if kv == "fp8" else None
    cache = torch.randn(num_blocks, block_size, lora + rope, device="cuda")
    cache = (cache / 0.02).to(cache_dtype) if kv == "fp8" else cache.to(cache_dtype)
    for batch in (1, 6):
        q_nope = torch.randn(batch, heads, lora, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
        block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device="cuda")
        seq_lens = torch.ones(batch, dtype=torch.int32, device="cuda")
        out = torch.empty(batch, heads, lora, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")
        attn_logits = torch.full((batch, heads, splits, attn_logits_width(lora)), float("nan"), device="cuda")

        def step():
            mla_decode_fwd(q_nope, q_pe, cache, block_table, seq_lens, scale, k_scale=k_scale, num_kv_splits=splits,
                           attn_logits=attn_logits, out=out, lse=lse, config=config)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for trial in range(3):
            new_lens = torch.randint(1, max_blocks * block_size, (batch,), device="cuda", dtype=torch.int32)
            new_lens[0] = trial  # 0, 1, 2
            seq_lens.copy_(new_lens)
            block_table.copy_(torch.randint(0, num_blocks, (batch, max_blocks), device="cuda", dtype=torch.int32))
            q_nope.normal_()
            out.fill_(float("nan"))
            attn_logits.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = _reference(q_nope, q_pe, cache, block_table, seq_lens, scale, k_scale)
            assert not torch.isnan(out).any(), (batch, trial)
            finite = torch.isfinite(ref_lse)
            rel = (out.double() - ref_out)[finite].norm() / ref_out[finite].norm().clamp_min(1e-30)
            bound = FP8_QK_REL_ERR if config.raw_stages else 1e-2
            assert rel <= bound or not finite.any(), (batch, trial, float(rel))
            if config.raw_stages:  # exact against the query the FP8 QK path computes with
                emulated = _e4m3_query({"q_nope": q_nope, "q_pe": q_pe})
                ref_out, _ = _reference(emulated["q_nope"], emulated["q_pe"], cache, block_table, seq_lens, scale, k_scale)
                rel = (out.double() - ref_out)[finite].norm() / ref_out[finite].norm().clamp_min(1e-30)
                assert rel <= _emulated_rel_err(config) or not finite.any(), (batch, trial, float(rel))
            assert torch.equal(torch.isfinite(lse), finite), (batch, trial)


def test_triton_sparse_in_place_decode_goes_through_the_dense_decode_impl(monkeypatch):
    """The plumbing of TRITON's in-place fp8_ds_mla sparse decode, on the CPU with the kernel launch recorded:
    the dense decode gets the cache as one-token pages, the compacted table, and the split count the
    heuristic gives an e4m3fn cache of that shape, the same in each call; the scale is the call's."""
    from mla_multi.backends.triton import TritonSparseDecodeImpl
    from mla_multi.heuristics import max_num_kv_splits, num_kv_splits
    from mla_multi.kernels import mla_decode
    from mla_multi.platforms import override

    calls = []

    def record(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, **kwargs):
        calls.append((kv_cache.shape, block_table.shape, scale, kwargs["num_kv_splits"], kwargs["attn_logits"].shape))
        return kwargs["out"], kwargs["lse"]

    monkeypatch.setattr(mla_decode, "mla_decode_fwd", record)
    with override("H100"):
        impl = TritonSparseDecodeImpl(128, 512, 64, torch.device("cpu"))
        pages = torch.zeros(4096, 1, 656, dtype=torch.uint8)
        table = torch.zeros(32, 2048, dtype=torch.int32)
        lens = torch.full((32,), 2048, dtype=torch.int32)
        q_nope, q_pe = torch.zeros(32, 128, 512, dtype=torch.bfloat16), torch.zeros(32, 128, 64, dtype=torch.bfloat16)
        for scale in (0.5, 0.25):
            out, lse = impl._decode_pages("in place", q_nope, q_pe, pages, table, lens, scale)
            assert out.shape == (32, 128, 512) and lse.shape == (32, 128)
        from mla_multi.platforms import current_platform

        platform = current_platform()
        splits = num_kv_splits(platform, 32, 128, 2048, max_num_kv_splits(2048, platform),
                               kv_cache_dtype=torch.float8_e4m3fn)
    assert [c[2] for c in calls] == [0.5, 0.25] and calls[0][3] == calls[1][3]
    assert calls[0][0] == (4096, 1, 656) and calls[0][1] == (32, 2048) and calls[0][3] == splits
    assert calls[0][4] == (32, 128, splits, 528)
    assert "not a GPU launch" in impl._in_place_reason(pages, torch.bfloat16)


@pytest.mark.gpu
@requires_hopper
@pytest.mark.parametrize("kernel", ["wgmma_ws", "wgmma_rm", "wgmma_rm_tma", "wgmma_ws_tma"])
@pytest.mark.parametrize("block_size", [1, 64])
def test_a_zero_rotary_query_reads_no_rotary_column(kernel, block_size):
    """`zero_rope` (DeepSeek-V4's rows laid out 576 wide): the sm_90 kernels neither multiply nor copy the
    rows' rotary columns, by cp.async (pages of one token) and by TMA tiles (pages of 64, 16 query rows): NaN
    in every rotary column leaves the output and LSE the latent attention's (float64)."""
    from mla_multi.kernels.mla_decode import DecodeKernelPlan, attn_logits_width

    heads, batch = 32, 16
    seq_lens = [0, 1, 17, 300, 4096] + [64 * (i + 1) + i for i in range(batch - 5)]
    tensors = _make_case(batch, heads, 1, 512, 64, block_size, seq_lens, torch.bfloat16, torch.bfloat16, "cuda", 11)
    tensors["q_pe"] = torch.zeros_like(tensors["q_pe"])
    reference = dict(tensors, kv_cache=tensors["kv_cache"].clone())
    reference["kv_cache"][..., 512:] = 0
    tensors["kv_cache"][..., 512:] = float("nan")
    config = _config_for(heads, 1, kernel)
    scale = 512**-0.5
    for splits in (1, 3):
        out = torch.full((batch, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((batch, heads), float("nan"), dtype=torch.float32, device="cuda")
        logits = torch.full((batch, heads, splits, attn_logits_width(512)), float("nan"), device="cuda")
        t = tensors
        plan = DecodeKernelPlan(t["q_nope"], t["q_pe"], t["kv_cache"], t["block_table"], t["seq_lens"], None, splits,
                                logits, out, lse, config=config, zero_rope=True)
        assert plan.tma == (kernel.endswith("_tma") and block_size == 64), (kernel, block_size, plan.tma)
        plan.launch(t["q_nope"], t["q_pe"], t["kv_cache"], t["block_table"], t["seq_lens"], None, logits, out, lse,
                    scale)
        torch.cuda.synchronize()
        result = _errors(reference, out, lse, scale)
        assert not result["nan"], (splits, result)
        assert result["inf_pattern_ok"] and result["empty_rows_zero"], (splits, result)
        assert result["rel_err"] <= 1e-2 and result["lse_err"] <= 2e-2, (splits, result)
