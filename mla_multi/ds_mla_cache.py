"""FlashMLA's "fp8_ds_mla" KV-cache layout (DeepSeek-V3.2 sparse attention), in PyTorch.

One cache token is 656 bytes, a ``uint8 [num_blocks, block_size, 656]`` cache:

* bytes 0-511: the 512 latent values as float8_e4m3fn, each 128-value tile
  divided by its own scale;
* bytes 512-527: the 4 tile scales as float32, ``max(amax(tile) / 448, FLT_MIN)``
  (448 is e4m3fn's largest value; the scale of an all-zero tile stays positive);
* bytes 528-655: the 64 rotary values as bfloat16, unquantised.

The values are e4m3fn on every platform, gfx942 included (whose own FP8 is
e4m3fnuz): the bytes are the format, so a cache written by one backend is read
by any other; a gfx942 kernel decodes the e4m3fn bits in software, as the dense
kernels already do for a cache whose FP8 flavour the hardware lacks.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_DS_MLA_BYTES",
    "KV_LORA_RANK",
    "ROPE_DIM",
    "TILE",
    "quantize_fp8_ds_mla",
    "dequantize_fp8_ds_mla",
    "is_fp8_ds_mla",
]

KV_LORA_RANK = 512
ROPE_DIM = 64
TILE = 128
NUM_TILES = KV_LORA_RANK // TILE
FP8_DS_MLA_BYTES = KV_LORA_RANK + 4 * NUM_TILES + 2 * ROPE_DIM  # 656
_FP8_MAX = 448.0
_FLT_MIN = torch.finfo(torch.float32).tiny


def is_fp8_ds_mla(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` is in the fp8_ds_mla layout (uint8, last dimension 656)."""
    return kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == FP8_DS_MLA_BYTES


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, 512] latent and [T, 64] rotary rows -> uint8 [T, 656] cache rows (scales from the data)."""
    if kv_c.shape[-1] != KV_LORA_RANK or k_pe.shape[-1] != ROPE_DIM:
        raise ValueError(
            f"kv_c has width {kv_c.shape[-1]} and k_pe {k_pe.shape[-1]}; the fp8_ds_mla layout holds "
            f"{KV_LORA_RANK} latent and {ROPE_DIM} rotary values"
        )
    tokens = kv_c.shape[0]
    tiles = kv_c.float().reshape(tokens, NUM_TILES, TILE)
    scales = (tiles.abs().amax(dim=-1) / _FP8_MAX).clamp_min(_FLT_MIN)  # [T, 4]
    values = (tiles / scales.unsqueeze(-1)).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    rows = torch.empty(tokens, FP8_DS_MLA_BYTES, dtype=torch.uint8, device=kv_c.device)
    rows[:, :KV_LORA_RANK] = values.reshape(tokens, KV_LORA_RANK).view(torch.uint8)
    # explicit widths: -1 is ambiguous for zero tokens
    rows[:, KV_LORA_RANK:KV_LORA_RANK + 4 * NUM_TILES] = scales.contiguous().view(torch.uint8).reshape(tokens, 4 * NUM_TILES)
    rows[:, KV_LORA_RANK + 4 * NUM_TILES:] = (
        k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(tokens, 2 * ROPE_DIM))
    return rows


def dequantize_fp8_ds_mla(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., 656] cache rows -> [..., 576] `[latent | rotary]` in `dtype` (latent = value x tile scale)."""
    if not is_fp8_ds_mla(rows):
        raise ValueError(
            f"rows have dtype {rows.dtype} and last dimension {rows.shape[-1]}; accepted: uint8 [..., {FP8_DS_MLA_BYTES}] "
            "(the fp8_ds_mla layout)"
        )
    lead = rows.shape[:-1]
    flat = rows.reshape(-1, FP8_DS_MLA_BYTES)
    values = flat[:, :KV_LORA_RANK].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, NUM_TILES, TILE)
    scales = flat[:, KV_LORA_RANK:KV_LORA_RANK + 4 * NUM_TILES].contiguous().view(torch.float32)
    rope = flat[:, KV_LORA_RANK + 4 * NUM_TILES:].contiguous().view(torch.bfloat16)
    latent = (values * scales.unsqueeze(-1)).reshape(-1, KV_LORA_RANK)
    return torch.cat([latent.to(dtype), rope.to(dtype)], dim=-1).reshape(*lead, KV_LORA_RANK + ROPE_DIM)
