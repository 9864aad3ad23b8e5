"""The cache byte formats (`mla_multi.cache_formats`): byte-exact with FlashMLA's reference quantiser
(tests/data/, see tests/data/README.md), round trips against float64 within each format's bound, the
geometry (block stride, block-tail scales), the V3.2 names of `mla_multi.ds_mla_cache`, and the cache writer
`concat_and_cache_mla_v4` for every format."""

from __future__ import annotations

import pathlib

import pytest
import torch

import mla_multi as mm
from mla_multi import cache_formats as cf
from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, dequantize_fp8_ds_mla, quantize_fp8_ds_mla

DATA = pathlib.Path(__file__).parent / "data"


def _golden(name: str) -> dict:
    return torch.load(DATA / f"{name}.pt", weights_only=True)


def _block_bytes_view(fmt: cf.CacheFormat, cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_bytes] of a cache (the padding of the last block included: allocate keeps it)."""
    stride = fmt.block_bytes(cache.shape[1])
    return torch.as_strided(cache, (cache.shape[0], stride), (stride, 1), cache.storage_offset())


@pytest.mark.parametrize("name", ["fp8_ds_mla", "fp8_ds_mla_v4"])
def test_writer_reproduces_flashmla_bytes(name):
    golden = _golden(name)
    fmt = cf.get_format(name)
    blocks, block_size = golden["num_blocks"], golden["block_size"]
    cache = fmt.allocate(blocks, block_size)
    rows = golden["input_bf16"].reshape(-1, fmt.width)
    options = {"power_of_two_scales": True} if name == "fp8_ds_mla" else {}
    fmt.write_rows(cache, torch.arange(blocks * block_size), rows, **options)
    expected = golden["cache_bytes"]
    got = _block_bytes_view(fmt, cache).reshape(expected.shape) if fmt.scales_in_block_tail else cache
    mismatched = (got != expected).nonzero()
    assert mismatched.numel() == 0, f"{mismatched.shape[0]} bytes differ, first at {mismatched[:4].tolist()}"


@pytest.mark.parametrize("name", ["fp8_ds_mla", "fp8_ds_mla_v4"])
def test_reader_matches_flashmla_dequantiser(name):
    golden = _golden(name)
    fmt = cf.get_format(name)
    blocks, block_size = golden["num_blocks"], golden["block_size"]
    cache = fmt.allocate(blocks, block_size)
    _block_bytes_view(fmt, cache).reshape(golden["cache_bytes"].shape).copy_(golden["cache_bytes"]) \
        if fmt.scales_in_block_tail else cache.copy_(golden["cache_bytes"])
    rows = fmt.read_rows(cache, torch.float64).reshape(blocks, block_size, fmt.width)
    assert torch.equal(rows.to(torch.bfloat16), golden["dequantized_bf16"])


def test_v4_layout_places_scales_in_the_block_tail():
    fmt = cf.FP8_DS_MLA_V4
    assert fmt.block_bytes(64) == 65 * 576 and fmt.block_bytes(5) == 6 * 576 and fmt.block_bytes(72) == 73 * 576
    cache = fmt.allocate(2, 3)
    assert cache.shape == (2, 3, 584) and cache.stride() == (fmt.block_bytes(3), 584, 1)
    rows = torch.zeros(1, 512)
    rows[0, 0] = 448.0 * 4  # scale 4 (UE8M0 byte 129) for the first 64 values, value 448 (e4m3 0x7E)
    rows[0, 448] = 1.0  # the first RoPE value, bf16 0x3F80
    fmt.write_rows(cache, torch.tensor([4]), rows)  # block 1, offset 1
    raw = _block_bytes_view(fmt, cache)[1]
    assert raw[576 + 0] == 0x7E  # token 1's data starts at 576
    assert raw[576 + 448] == 0x80 and raw[576 + 449] == 0x3F
    tail = raw[3 * 576:3 * 584].view(3, 8)
    # scale 4 = 2 ** 2 (byte 129); the zero tiles get the 2 ** -13 floor (byte 114); the pad byte stays 0
    assert tail[1].tolist() == [129, 114, 114, 114, 114, 114, 114, 0]


def test_ue8m0_floor_is_flashmlas():
    # an all-zero tile: 2 ** ceil(log2(1e-4)) = 2 ** -13, byte 114
    scales = cf._ue8m0_scales(torch.zeros(1))
    assert scales.item() == 2.0 ** -13 and cf._ue8m0_bytes(scales).item() == 114


def test_v41_layout_keeps_each_tokens_scales_after_its_data():
    fmt = cf.FP8_DS_MLA_V41
    rows = torch.zeros(2, 512)
    rows[1, 32] = 3.0  # second group of token 1: amax 3 -> scale 2 ** ceil(log2(3 / 448)) = 2 ** -7
    records = fmt.quantize(rows)
    assert records.shape == (2, 528)
    assert records[1, 512 + 1].item() == 127 - 7
    assert records[1, 32].item() == torch.tensor(3.0 * 128).to(torch.float8_e4m3fn).view(torch.uint8).item()
    cache = fmt.allocate(1, 2)
    fmt.write_rows(cache, torch.tensor([0, 1]), rows)
    assert torch.equal(cache.reshape(2, 528), records)  # token after token


def test_fp4_packs_the_even_value_in_the_low_nibble():
    fmt = cf.FP4_DS_MLA_V41
    rows = torch.zeros(1, 512)
    rows[0, 0], rows[0, 1] = 6.0, -1.0  # scale e4m3(6 / 6) = 1: codes 7 and 8 | 2
    records = fmt.quantize(rows)
    assert records.shape == (1, 288)
    assert records[0, 0].item() == 0x7 | (0xA << 4)
    assert records[0, 256].item() == torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert records[0, 257].item() == 0  # a zero group has scale 0
    assert fmt.dequantize(records, torch.float64)[0, :3].tolist() == [6.0, -1.0, 0.0]
    assert fmt.second_segment_only and fmt.main_formats == ("fp8_ds_mla_v41",)


def test_e2m1_rounds_to_nearest_even():
    values = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.1, -0.3])
    got = cf._e2m1_values(cf._e2m1_codes(values.clamp(-6, 6)), torch.float64).tolist()
    assert got == [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0, -0.5]


def _bound(fmt: cf.CacheFormat, x: torch.Tensor) -> torch.Tensor:
    """The format's element error bound for float64 rows x [T, width]: e4m3 keeps 3 mantissa bits (relative
    2**-4, absolute scale * 2**-10 below its normals); bf16 RoPE 2**-8 relative; e2m1 a quarter of the value or
    of the scale (its widest gap, 4 -> 6, is 2 at 5), the e4m3 scale rounding included."""
    groups = fmt.values_per_scale
    bound = torch.zeros_like(x)
    quantised = fmt.width if fmt.quantizes_rope else fmt.width - fmt.rope_dims
    tiles = x[:, :quantised].reshape(x.shape[0], -1, groups)
    amax = tiles.abs().amax(-1, keepdim=True)
    if fmt.name == "fp4_ds_mla_v41":
        # the e4m3 scale s' of s = amax / 6 is off by at most max(s * 2**-4, 2**-10) (2**-9 its smallest step);
        # a value inside +-6 s' is off by half a gap (max(s' / 4, |x| / 4)), one past it by 6 |s - s'|
        scale = amax / 6
        scale_error = torch.clamp_min(scale * 2.0 ** -4, 2.0 ** -10)
        element = torch.maximum((scale + scale_error) * 0.25, tiles.abs() * 0.25) + 6 * scale_error
        bound[:, :quantised] = element.reshape(x.shape[0], -1)
    else:
        scale = torch.clamp_min(amax / 448, 1e-4) * 2 if fmt.scale_dtype != "float32" else amax / 448
        bound[:, :quantised] = torch.maximum(tiles.abs() * 2.0 ** -4, scale * 2.0 ** -10).reshape(x.shape[0], -1)
    if not fmt.quantizes_rope:
        bound[:, quantised:] = x[:, quantised:].abs() * 2.0 ** -8
    return bound * (1 + 1e-6)


@pytest.mark.parametrize("name", list(cf.FORMATS))
def test_round_trip_within_the_formats_bound(name):
    fmt = cf.get_format(name)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(16, fmt.width, generator=generator, dtype=torch.float64)
    # tiny rows (under the UE8M0 floor, under e4m3's smallest FP4 scale) to large ones (FP4's e4m3 scales saturate
    # at 448: the format holds values up to 6 * 448)
    x *= torch.logspace(-6, 2.5, 16, dtype=torch.float64).unsqueeze(1)
    x[3] = 0.0
    back = fmt.dequantize(fmt.quantize(x), torch.float64)
    error = (back - x).abs()
    bound = _bound(fmt, x)
    assert bool((error <= bound).all()), f"worst excess {(error - bound).max().item()}"
    assert torch.equal(back[3], torch.zeros(fmt.width, dtype=torch.float64))


def test_ds_mla_cache_names_still_work():
    kv_c = torch.randn(3, 512)
    k_pe = torch.randn(3, 64)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    assert rows.shape == (3, FP8_DS_MLA_BYTES) and rows.dtype == torch.uint8
    assert torch.equal(rows, cf.FP8_DS_MLA.quantize(torch.cat([kv_c, k_pe], -1)))
    back = dequantize_fp8_ds_mla(rows)
    assert torch.allclose(back[:, :512], kv_c, rtol=2 ** -4, atol=1e-6)
    with pytest.raises(ValueError, match="fp8_ds_mla layout"):
        quantize_fp8_ds_mla(kv_c[:, :448], k_pe)


def test_format_of_and_check_cache_name_the_argument():
    assert cf.format_of(cf.FP8_DS_MLA_V41.allocate(1, 4)) is cf.FP8_DS_MLA_V41
    assert cf.format_of(torch.zeros(1, 4, 512, dtype=torch.bfloat16)) is None
    with pytest.raises(ValueError, match="kv_cache .*in no cache format.*584 \\(fp8_ds_mla_v4\\)"):
        cf.check_cache("kv_cache", torch.zeros(1, 4, 600, dtype=torch.uint8))
    with pytest.raises(ValueError, match="extra_kv_cache has .*fp8_ds_mla_v41 format is uint8 \\[num_blocks, block_size, 528\\]"):
        cf.check_cache("extra_kv_cache", torch.zeros(1, 4, 584, dtype=torch.uint8), "fp8_ds_mla_v41")
    unpadded = torch.zeros(2, 4, 584, dtype=torch.uint8)  # blocks not padded to 576 bytes
    with pytest.raises(ValueError, match="kv_cache has strides .*padded to a multiple of 576"):
        cf.check_cache("kv_cache", unpadded)
    with pytest.raises(ValueError, match="kv_format='v5'; accepted"):
        cf.get_format("v5")


@pytest.mark.parametrize("name", list(cf.FORMATS))
def test_concat_and_cache_mla_v4_writes_every_format(name):
    fmt = cf.get_format(name)
    latent = fmt.width - fmt.rope_dims
    kv_c = torch.randn(5, latent, dtype=torch.bfloat16)
    k_pe = torch.randn(5, fmt.rope_dims, dtype=torch.bfloat16)
    cache = fmt.allocate(3, 4)
    slots = torch.tensor([11, -1, 0, 5, 6])
    mm.ops.concat_and_cache_mla_v4(kv_c, k_pe, cache, slots)
    rows = fmt.read_rows(cache, torch.float32)
    expected = fmt.dequantize(fmt.quantize(torch.cat([kv_c, k_pe], -1)), torch.float32)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(rows[slot], expected[token])
    untouched = [s for s in range(12) if s not in slots.tolist()]
    assert torch.equal(fmt.read_records(cache, torch.tensor(untouched)), torch.zeros(len(untouched), fmt.bytes_per_token,
                                                                                    dtype=torch.uint8))


@pytest.mark.parametrize("name", list(cf.FORMATS))
@pytest.mark.parametrize("slots", [[-1, -1], [-1, 3, -1, 5], [-2, 0]], ids=["none kept", "first skipped", "slot 0"])
def test_concat_and_cache_mla_v4_skipped_tokens_change_no_byte(name, slots):
    """Skipped tokens (negative slots) leave every byte of the cache (the blocks' padding too) but the kept
    tokens' records as it was: the writer is free of host synchronisation, so a skipped token writes a record
    that is already there or being written."""
    fmt = cf.get_format(name)
    latent = fmt.width - fmt.rope_dims
    cache = fmt.allocate(3, 4, fill=7)
    expected = fmt.allocate(3, 4, fill=7)
    slots = torch.tensor(slots)
    rows = torch.randn(len(slots), fmt.width, dtype=torch.bfloat16)
    mm.ops.concat_and_cache_mla_v4(rows[:, :latent], rows[:, latent:], cache, slots)
    kept = slots >= 0
    if kept.any():
        fmt.write_records(expected, slots[kept], fmt.quantize(rows[kept]))
    assert torch.equal(_block_bytes_view(fmt, cache), _block_bytes_view(fmt, expected))


def test_concat_and_cache_mla_v4_zero_tokens_is_a_no_op():
    cache = cf.FP8_DS_MLA_V4.allocate(2, 4, fill=7)
    before = _block_bytes_view(cf.FP8_DS_MLA_V4, cache).clone()
    mm.ops.concat_and_cache_mla_v4(torch.zeros(0, 448), torch.zeros(0, 64), cache, torch.zeros(0, dtype=torch.int64))
    assert torch.equal(_block_bytes_view(cf.FP8_DS_MLA_V4, cache), before)


def test_concat_and_cache_mla_v4_errors_name_the_argument():
    cache = cf.FP8_DS_MLA_V4.allocate(2, 4)
    with pytest.raises(ValueError, match="kv_cache has .*528"):
        mm.ops.concat_and_cache_mla_v4(torch.zeros(1, 448), torch.zeros(1, 64), cache, torch.zeros(1, dtype=torch.int64),
                                   kv_format="fp8_ds_mla_v41")
    with pytest.raises(ValueError, match="kv_c"):
        mm.ops.concat_and_cache_mla_v4(torch.zeros(1, 512), torch.zeros(1, 64), cache, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping"):
        mm.ops.concat_and_cache_mla_v4(torch.zeros(1, 448), torch.zeros(1, 64), cache, torch.tensor([8]))


def test_the_v4_writer_and_the_v32_writer_agree_on_fp8_ds_mla():
    kv_c, k_pe = torch.randn(6, 512, dtype=torch.bfloat16), torch.randn(6, 64, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, -1, 7, 2, 3])
    v32 = torch.zeros(2, 4, FP8_DS_MLA_BYTES, dtype=torch.uint8)
    v4 = cf.FP8_DS_MLA.allocate(2, 4)
    mm.ops.concat_and_cache_mla(kv_c, k_pe, v32, slots)
    mm.ops.concat_and_cache_mla_v4(kv_c, k_pe, v4, slots)
    assert torch.equal(v32, v4)
