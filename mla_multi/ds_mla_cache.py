"""FlashMLA's "fp8_ds_mla" KV-cache layout (DeepSeek-V3.2 sparse attention), in PyTorch.

The names of this module stay; the format itself is `mla_multi.cache_formats.FP8_DS_MLA`
(where every cache format is described), which these functions call.

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

from mla_multi.cache_formats import FP8_DS_MLA

__all__ = [
    "FP8_DS_MLA_BYTES",
    "KV_LORA_RANK",
    "ROPE_DIM",
    "TILE",
    "quantize_fp8_ds_mla",
    "dequantize_fp8_ds_mla",
    "is_fp8_ds_mla",
]

KV_LORA_RANK = FP8_DS_MLA.width - FP8_DS_MLA.rope_dims  # 512
ROPE_DIM = FP8_DS_MLA.rope_dims  # 64
TILE = FP8_DS_MLA.values_per_scale  # 128
NUM_TILES = FP8_DS_MLA.num_scales  # 4
FP8_DS_MLA_BYTES = FP8_DS_MLA.bytes_per_token  # 656


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
    dtype = torch.promote_types(kv_c.dtype, k_pe.dtype)
    return FP8_DS_MLA.quantize(torch.cat([kv_c.to(dtype), k_pe.to(dtype)], dim=-1))


def dequantize_fp8_ds_mla(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., 656] cache rows -> [..., 576] `[latent | rotary]` in `dtype` (latent = value x tile scale)."""
    if not is_fp8_ds_mla(rows):
        raise ValueError(
            f"rows have dtype {rows.dtype} and last dimension {rows.shape[-1]}; accepted: uint8 [..., {FP8_DS_MLA_BYTES}] "
            "(the fp8_ds_mla layout)"
        )
    return FP8_DS_MLA.dequantize(rows, dtype)
