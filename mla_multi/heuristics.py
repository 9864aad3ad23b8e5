"""Split-KV decode heuristics: how many KV splits, and how many to reserve.

Pure functions of (platform, config): tests impersonate any device through
`mla_multi.platforms.SPECS`.

The model (``num_kv_splits``)
-----------------------------
Stage 1 of split-KV decode launches ``B * head_blocks * s`` programs, where a
head block is ``BLOCK_H`` query rows (heads x query tokens) of the launch
configuration that `mla_multi.kernels.launch_config.decode_config` picks for
the platform.  ``slots = num_compute_units * programs_per_cu`` programs run at
once.  Time is counted in "token slots": the time one running program needs to
stream one cache token (576 values) through the tile loop.

* stage 1: ``ceil(programs / slots)`` waves, each as long as one program's
  chunk, ``round_up(ceil(S / s), BLOCK_N)`` tokens, plus a fixed
  ``PROGRAM_OVERHEAD_TOKENS`` (loading the query tile, filling the pipeline,
  writing the partial result);
* stage 2 (only when ``s > 1``): the partial outputs, ``B * rows * s * (Lkv + 1)``
  float32 values, are written once and read once; at the rate the whole device
  streams cache rows this costs ``B * rows * s * (Lkv + 1) * 8 / (slots * (Lkv + R) * elem)``
  token slots, with ``elem`` at least 2 bytes (the kernels convert an FP8 tile
  to 16 bits before its products, and its token slot lasts as long as a 16-bit
  one: on an H200, 2.4-2.6 µs per 64-token tile either way; B=1, N=64,
  S=32768, FP8: 128 splits 28.9 µs, 64 splits 33.1 µs); plus the merge
  kernel's launch and its chain of dependent steps (64 splits per step),
  ``REDUCE_FIXED_TOKENS + ceil(s / 64) * REDUCE_STEP_TOKENS``
  (a token slot is about 70 ns on an H200 at full occupancy, so these are ~3 µs
  and ~4 µs; measured on an H200, B=1, N=16, S=32768: 128 splits 27.9 µs,
  256 splits 30.5 µs, 64 splits 34.0 µs; B=32, S=4096: 4 / 8 / 16 splits
  61.2 / 55.0 / 62.7 µs);

and ``s`` minimises the sum, ties going to fewer splits.  ``s`` is also capped
so that a split holds at least ``MIN_TOKENS_PER_SPLIT`` tokens and never exceeds
the splits reserved in the workspace.  The result: a small batch of long
sequences is spread over all compute units; a batch that already fills the
device (128 requests x 2 head blocks on 132 SMs) gets 1 split and skips the
merge; more heads make splits dearer (each split writes ``rows`` partial rows).
The same shape of model underlies FlashDecoding's and vLLM's occupancy-aware
split choice; vLLM's Triton MLA uses only sequence length and SM count.

The workspace bound (``max_partial_rows``)
------------------------------------------
Every decode layer of a device shares one workspace (`mla_multi.workspace`),
reserved once for the most partial results any batch can ask: ``B * Q * s``
rows of ``N`` heads when ``s > 1`` (one split writes straight to the output).
`max_partial_rows` bounds that product simply: the programs of a split launch,
``B * head_blocks * s``, never exceed ``PARTIAL_WAVES`` waves of the device
(nor the splits one request may take), and `num_kv_splits` never picks a
split count past that bound.  With 16 waves the bound changes the modelled
cost of a choice by at most 3.3 % (H100, every B <= 256, S <= 32768, 16-128
heads; 0 in most configurations) and reserves, for 256 requests of 32768
tokens, 4224 rows of 16 heads (136 MiB of partials) or 1056 rows of 128 heads
(272 MiB)
on an H100 or H200.

``MLA_MULTI_NUM_KV_SPLITS`` overrides the choice (still clamped to the
reservation).
"""

from __future__ import annotations

import functools
import math

import torch

from mla_multi.checks import check_positive_int

__all__ = [
    "MIN_TOKENS_PER_SPLIT",
    "PARTIAL_WAVES",
    "gathered_tile_splits",
    "max_partial_rows",
    "PROGRAM_OVERHEAD_TOKENS",
    "num_kv_splits",
    "max_num_kv_splits",
]

MIN_TOKENS_PER_SPLIT = 128
PROGRAM_OVERHEAD_TOKENS = 32
REDUCE_FIXED_TOKENS = 48
REDUCE_STEP_TOKENS = 64
REDUCE_SPLITS_PER_STEP = 64
# Upper bound of the reservation whatever the device: with 128 heads and 256
# decode requests a split costs 67 MB of float32 workspace.
MAX_KV_SPLITS_CAP = 256
# Waves of split programs (see "The workspace bound") a decode batch may launch when it splits.
PARTIAL_WAVES = 16


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def max_num_kv_splits(max_model_len: int, platform, *, min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT) -> int:
    """Splits to reserve in the ``attn_logits`` workspace for sequences up to `max_model_len`.

    The most `num_kv_splits` can return for any batch on `platform`: one split
    per `min_tokens_per_split` tokens (``MIN_TOKENS_PER_SPLIT``), at most enough to give every compute
    unit two programs from a single request and head block (rounded up to a
    power of two), and at most ``MAX_KV_SPLITS_CAP``.
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len={max_model_len}; accepted: >= 1")
    by_length = -(-max_model_len // min_tokens_per_split)
    by_device = 1 << max(0, math.ceil(math.log2(max(1, 2 * platform.num_compute_units))))
    return max(1, min(by_length, by_device, MAX_KV_SPLITS_CAP))


def _occupancy(platform, num_heads: int, q_len: int, kv_cache_dtype: torch.dtype,
               kv_lora_rank: int = 512, qk_rope_head_dim: int = 64) -> tuple:
    """(launch configuration, head blocks per request, programs the device runs at once)."""
    from mla_multi import envs

    # the launch table reads MLA_MULTI_FP8_QK: its value is part of the key
    return _occupancy_of(platform, num_heads, q_len, kv_cache_dtype, kv_lora_rank, qk_rope_head_dim,
                         envs.MLA_MULTI_FP8_QK)


@functools.lru_cache(maxsize=256)
def _occupancy_of(platform, num_heads: int, q_len: int, kv_cache_dtype: torch.dtype, kv_lora_rank: int,
                  qk_rope_head_dim: int, fp8_qk: bool) -> tuple:
    from mla_multi.kernels.launch_config import decode_config

    config = decode_config(platform, num_heads, q_len, kv_cache_dtype, kv_lora_rank, qk_rope_head_dim, fp8_qk=fp8_qk)
    head_blocks = -(-(num_heads * q_len) // config.block_h)
    slots = max(1, platform.num_compute_units * config.programs_per_cu)
    return config, head_blocks, slots


def max_partial_rows(
    platform,
    num_heads: int,
    max_num_seqs: int,
    max_model_len: int,
    *,
    q_len: int = 1,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    kv_cache_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """The most split-KV partial rows (requests x query tokens x splits) a decode batch of at most
    `max_num_seqs` requests of `q_len` tokens can ask on `platform`, sequences up to `max_model_len`.

    `num_kv_splits` given this bound never exceeds it; the workspace reserves
    this many rows of ``num_heads x attn_logits_width`` float32 values. At
    least ``max_num_seqs * q_len`` (a batch that does not split still views
    one split per row).
    """
    for name, value in (("num_heads", num_heads), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                        ("q_len", q_len)):
        check_positive_int(name, value)
    _, head_blocks, slots = _occupancy(platform, num_heads, q_len, kv_cache_dtype, kv_lora_rank, qk_rope_head_dim)
    max_splits = max_num_kv_splits(max_model_len, platform)
    programs = max(head_blocks * max_splits, PARTIAL_WAVES * slots)
    return q_len * max(max_num_seqs, min(max_num_seqs * max_splits, programs // head_blocks))


def gathered_tile_splits(platform, batch_size: int, num_heads: int, max_seq_len: int, *,
                         kv_cache_dtype: torch.dtype = torch.uint8, q_len: int = 1) -> int:
    """The number of KV splits for a decode whose tiles are gathered row by row (DeepSeek-V4 caches read in
    place: every row's address waits on its own index, so a tile costs the memory's latency several times
    over, far more than a streamed tile, and the partial rows of a split are cheap beside it): the count that
    fills one wave of the device's programs, ``slots // (batch x head blocks)``, within 1 .. the tiles of
    `max_seq_len`. Measured on an H200 (bench/RESULTS.md, V4 top-k 512 + a 128 window): at 64 heads B = 64 and
    128 heads B = 32 two splits take 42.8 and 40.5 µs against 51.8 and 50.6 for one; at 128 heads B = 64 / 128
    one split 56.5 / 106.5 against 73.7 / 142.7 for two; at one token the most splits. ``MLA_MULTI_NUM_KV_SPLITS``
    overrides it."""
    for name, value in (("batch_size", batch_size), ("num_heads", num_heads), ("q_len", q_len)):
        check_positive_int(name, value)
    forced = _env_override()
    if forced is not None:
        return max(1, int(forced))
    config, head_blocks, slots = _occupancy(platform, num_heads, q_len, kv_cache_dtype)
    tiles = max(1, -(-max_seq_len // config.block_n))
    return max(1, min(tiles, slots // (batch_size * q_len * head_blocks)))


def _env_override() -> int | None:
    from mla_multi import envs

    return envs.MLA_MULTI_NUM_KV_SPLITS


def num_kv_splits(
    platform,
    batch_size: int,
    num_heads: int,
    max_seq_len: int,
    max_num_kv_splits: int,
    *,
    q_len: int = 1,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    kv_cache_dtype: torch.dtype = torch.bfloat16,
    max_partial_rows: int | None = None,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """The number of KV splits for a decode batch (see the module docstring for the model).

    Args:
        platform: the `Platform` the kernel runs on (compute units, launch configuration).
        batch_size: requests in the decode batch (B).
        num_heads: query heads (N).
        max_seq_len: the longest sequence of the batch, or the bound the batch
            is captured for (e.g. max_model_len under CUDA graphs).
        max_num_kv_splits: the splits reserved in the workspace; never exceeded.
        q_len: query tokens per request (multi-token decode).
        kv_lora_rank, qk_rope_head_dim, kv_cache_dtype: cache row shape and type.
        max_partial_rows: the partial rows reserved in the workspace (`max_partial_rows()`);
            ``batch_size * q_len * splits`` never exceeds it when splitting. None: no bound.
        min_tokens_per_split: the fewest tokens a split holds (the sparse decode's index lists, read
            without a page table's indirection, go down to one 64-token tile).

    Returns:
        An int in 1 .. max_num_kv_splits.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("num_heads", num_heads),
        ("max_num_kv_splits", max_num_kv_splits),
        ("q_len", q_len),
    ):
        check_positive_int(name, value)
    if max_seq_len < 0:
        raise ValueError(f"max_seq_len={max_seq_len}; accepted: >= 0")
    if max_partial_rows is not None:
        # splits whose partial rows fit the reservation
        max_num_kv_splits = max(1, min(max_num_kv_splits, max_partial_rows // (batch_size * q_len)))
    forced = _env_override()
    if forced is not None:
        return max(1, min(int(forced), max_num_kv_splits))
    if max_seq_len <= min_tokens_per_split:
        return 1

    config, head_blocks, slots = _occupancy(platform, num_heads, q_len, kv_cache_dtype)
    rows = num_heads * q_len
    # an FP8 tile is converted to 16 bits before its products: its token slot lasts as long as a 16-bit one
    row_bytes = (kv_lora_rank + qk_rope_head_dim) * max(2, _element_size(kv_cache_dtype))
    partial_bytes_per_split = batch_size * rows * (kv_lora_rank + 1) * 4 * 2

    limit = min(max_num_kv_splits, -(-max_seq_len // min_tokens_per_split))
    # a split's tokens, rounded up to whole tiles, depend on the length only through its tile count
    # (ceil(ceil(S / k) / n) = ceil(ceil(S / n) / k)): a step whose longest sequence grew by a token within its
    # last tile finds the choice made before
    tiles = -(-max_seq_len // config.block_n)
    return _cheapest_splits(config.block_n, head_blocks, slots, batch_size, partial_bytes_per_split, row_bytes,
                            max(1, limit), tiles)


@functools.lru_cache(maxsize=4096)
def _cheapest_splits(block_n: int, head_blocks: int, slots: int, batch_size: int, partial_bytes_per_split: int,
                     row_bytes: int, limit: int, tiles: int) -> int:
    """The split count in 1 .. limit of the lowest modelled cost (`num_kv_splits`), for a longest sequence
    of `tiles` tiles of `block_n` tokens."""
    best_splits, best_cost = 1, math.inf
    for splits in range(1, limit + 1):
        chunk = -(-tiles // splits) * block_n
        waves = -(-(batch_size * head_blocks * splits) // slots)
        cost = waves * (chunk + PROGRAM_OVERHEAD_TOKENS)
        if splits > 1:
            cost += splits * partial_bytes_per_split / (slots * row_bytes)
            cost += REDUCE_FIXED_TOKENS + -(-splits // REDUCE_SPLITS_PER_STEP) * REDUCE_STEP_TOKENS
        if cost < best_cost:
            best_splits, best_cost = splits, cost
    return best_splits
