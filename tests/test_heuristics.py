"""Split-KV heuristics on impersonated devices (pure functions of the platform)."""

from __future__ import annotations

import pytest
import torch

from mla_multi import heuristics
from mla_multi.heuristics import max_num_kv_splits, num_kv_splits
from mla_multi.kernels.launch_config import decode_config
from mla_multi.platforms import SPECS

DEVICES = ["MI300X", "MI355X", "RX7900XTX", "A100", "H100"]


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("MLA_MULTI_NUM_KV_SPLITS", raising=False)


@pytest.mark.parametrize("device", DEVICES)
def test_reservation_bounds(device):
    platform = SPECS[device]
    assert max_num_kv_splits(1, platform) == 1
    assert max_num_kv_splits(heuristics.MIN_TOKENS_PER_SPLIT * 3, platform) == 3
    big = max_num_kv_splits(163840, platform)
    assert 2 * platform.num_compute_units <= big <= heuristics.MAX_KV_SPLITS_CAP or big == heuristics.MAX_KV_SPLITS_CAP
    assert big & (big - 1) == 0  # a power of two


@pytest.mark.parametrize("device", DEVICES)
def test_small_batch_long_sequence_fills_the_device(device):
    platform = SPECS[device]
    reserved = max_num_kv_splits(32768, platform)
    splits = num_kv_splits(platform, 1, 16, 32768, reserved)
    config = decode_config(platform, 16, 1, torch.bfloat16)
    programs = splits * -(-16 // config.block_h)
    # spread over at least half the compute units (the merge cost stops it short of
    # all of them on the largest devices), within the reservation
    assert programs >= min(reserved, platform.num_compute_units) * 0.5
    assert splits <= reserved


@pytest.mark.parametrize("device", DEVICES)
def test_full_batch_needs_no_split(device):
    platform = SPECS[device]
    # 128 requests x 128 heads already give several programs per compute unit: at most a
    # few splits, chosen only to even out the last wave of programs
    splits = num_kv_splits(platform, 128, 128, 4096, max_num_kv_splits(4096, platform))
    assert splits <= 3
    if device == "H100":
        assert splits == 1


@pytest.mark.parametrize("device", DEVICES)
def test_more_requests_never_more_splits(device):
    platform = SPECS[device]
    reserved = max_num_kv_splits(8192, platform)
    chosen = [num_kv_splits(platform, batch, 16, 8192, reserved) for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert chosen == sorted(chosen, reverse=True), chosen
    assert chosen[0] > chosen[-1]


@pytest.mark.parametrize("device", ["H200", "H100"])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_fp8_cache_is_split_like_a_16_bit_one(device, heads):
    """The kernels convert an FP8 tile to 16 bits before its products, so a tile costs the time of a 16-bit one
    and the partial outputs are no dearer: a small FP8 batch spreads over the device as far as a bf16 one (with
    half the bytes per row, the model picked 64 splits instead of 128 at 64 heads on an H200: 33.1 against
    28.9 µs)."""
    platform = SPECS[device]
    reserved = max_num_kv_splits(32768, platform)
    bf16, fp8 = (decode_config(platform, heads, 1, dtype) for dtype in (torch.bfloat16, torch.float8_e4m3fn))
    splits = [
        num_kv_splits(platform, 1, heads, 32768, reserved, kv_cache_dtype=dtype)
        for dtype in (torch.bfloat16, torch.float8_e4m3fn)
    ]
    if (bf16.block_h, bf16.block_n, bf16.programs_per_cu) == (fp8.block_h, fp8.block_n, fp8.programs_per_cu):
        assert splits[1] == splits[0], splits
    programs = splits[1] * -(-heads // fp8.block_h)
    assert programs >= platform.num_compute_units * 0.9, (splits, fp8)


@pytest.mark.parametrize("device", DEVICES)
def test_short_sequences_are_not_split(device):
    platform = SPECS[device]
    assert num_kv_splits(platform, 1, 16, heuristics.MIN_TOKENS_PER_SPLIT, 64) == 1
    assert num_kv_splits(platform, 1, 16, 0, 64) == 1
    # never below MIN_TOKENS_PER_SPLIT tokens per split
    assert num_kv_splits(platform, 1, 16, 1000, 64) <= -(-1000 // heuristics.MIN_TOKENS_PER_SPLIT)


def test_choices_per_device_table():
    """The choices on each device for a few DeepSeek-V3 batches (readable in the test log)."""
    table = {}
    for device in DEVICES:
        platform = SPECS[device]
        for batch, heads, seq_len in ((1, 16, 32768), (32, 16, 4096), (64, 128, 8192), (128, 128, 4096)):
            reserved = max_num_kv_splits(seq_len, platform)
            table[(device, batch, heads, seq_len)] = num_kv_splits(platform, batch, heads, seq_len, reserved)
    print("\n".join(f"{key}: {value}" for key, value in table.items()))
    for device in DEVICES:
        # more compute units -> at least as many splits for the same small batch
        assert table[(device, 1, 16, 32768)] >= table[(device, 32, 16, 4096)]
    assert table[("MI300X", 1, 16, 32768)] >= table[("RX7900XTX", 1, 16, 32768)]


def test_env_override_is_clamped(monkeypatch):
    platform = SPECS["H100"]
    monkeypatch.setenv("MLA_MULTI_NUM_KV_SPLITS", "7")
    assert num_kv_splits(platform, 128, 128, 4096, 64) == 7
    monkeypatch.setenv("MLA_MULTI_NUM_KV_SPLITS", "500")
    assert num_kv_splits(platform, 1, 16, 32768, 64) == 64


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        num_kv_splits(SPECS["H100"], 0, 16, 10, 4)
    with pytest.raises(ValueError, match="max_model_len"):
        max_num_kv_splits(0, SPECS["H100"])


def test_min_tokens_per_split_lets_short_lists_split_to_one_tile():
    """The sparse decode's index lists (2048 tokens, no page table) may split down to 64-token tiles: one
    token of 128 heads on an H200 then takes 32 splits (64 programs) instead of 16; batches that already fill
    the device choose as before, and the default minimum stays 128 tokens a split."""
    h200 = SPECS["H200"]
    assert heuristics.MIN_TOKENS_PER_SPLIT == 128
    assert max_num_kv_splits(2048, h200) == 16
    assert max_num_kv_splits(2048, h200, min_tokens_per_split=64) == 32
    limit = max_num_kv_splits(2048, h200, min_tokens_per_split=64)
    assert num_kv_splits(h200, 1, 128, 2048, limit, kv_cache_dtype=torch.uint8, min_tokens_per_split=64) == 32
    assert num_kv_splits(h200, 1, 128, 2048, 16, kv_cache_dtype=torch.uint8) == 16
    for batch in (8, 16, 32, 64):
        assert num_kv_splits(h200, batch, 128, 2048, limit, kv_cache_dtype=torch.uint8, min_tokens_per_split=64) == \
            num_kv_splits(h200, batch, 128, 2048, 16, kv_cache_dtype=torch.uint8)
    assert num_kv_splits(h200, 1, 128, 64, limit, min_tokens_per_split=64) == 1  # one tile: no split


def test_the_choice_is_kept_per_tile_count_and_follows_the_launch_table_variable(monkeypatch):
    """The split choice is memoised by what it depends on: lengths within one tile of the launch
    configuration's block_n get the choice of the tile count (the cost model sees whole tiles only), a
    length one tile longer may not; the launch configuration is looked up again when
    MLA_MULTI_FP8_QK changes (it picks the FP8 cache's table)."""
    platform = SPECS["H200"]
    limit = max_num_kv_splits(32768, platform)
    config, _, _ = heuristics._occupancy(platform, 128, 1, torch.bfloat16)
    for tiles in (1, 3, 17, 64, 65, 128):
        choices = {num_kv_splits(platform, 1, 128, (tiles - 1) * config.block_n + extra, limit)
                   for extra in (1, config.block_n // 2, config.block_n)}
        assert len(choices) == 1, (tiles, choices)
    for value in ("0", "1"):
        monkeypatch.setenv("MLA_MULTI_FP8_QK", value)
        got, _, _ = heuristics._occupancy(platform, 128, 1, torch.float8_e4m3fn)
        assert got == decode_config(platform, 128, 1, torch.float8_e4m3fn)


@pytest.mark.parametrize("name", ["batch_size", "num_heads", "max_num_kv_splits", "q_len"])
@pytest.mark.parametrize("bad", [0, True, 2.0])
def test_num_kv_splits_names_a_count_that_is_not_a_positive_int(name, bad):
    """A bool is no count (True would read as 1), nor a float or 0: the error names the argument."""
    args = dict(batch_size=4, num_heads=16, max_num_kv_splits=8, q_len=1)
    args[name] = bad
    with pytest.raises(ValueError, match=rf"{name}={bad!r}; accepted: a positive int"):
        num_kv_splits(SPECS["H100"], max_seq_len=4096, **args)


def test_gathered_tile_splits_fill_one_wave_within_the_tiles(monkeypatch):
    """V4 caches read in place (`gathered_tile_splits`): the split count that fills one wave of an H100's / H200's
    programs (one 64-head program an SM), at least 1 and at most the tiles of the longest list; the values the
    H200 sweep found fastest (bench/RESULTS.md); MLA_MULTI_NUM_KV_SPLITS overrides it."""
    from mla_multi.heuristics import gathered_tile_splits

    platform = SPECS["H200"]
    width = 512 + 128
    assert gathered_tile_splits(platform, 64, 128, width) == 1
    assert gathered_tile_splits(platform, 128, 128, width) == 1
    assert gathered_tile_splits(platform, 64, 64, width) == 2
    assert gathered_tile_splits(platform, 32, 128, width) == 2
    assert gathered_tile_splits(platform, 1, 128, width) == 10  # every tile its own split
    assert gathered_tile_splits(platform, 1, 128, 0) == 1
    _, head_blocks, slots = heuristics._occupancy(platform, 16, 1, torch.uint8)
    assert gathered_tile_splits(platform, 4, 16, 1 << 16) == slots // (4 * head_blocks)
    monkeypatch.setenv("MLA_MULTI_NUM_KV_SPLITS", "3")
    assert gathered_tile_splits(platform, 64, 128, width) == 3
    with pytest.raises(ValueError, match="batch_size"):
        gathered_tile_splits(platform, 0, 128, width)
