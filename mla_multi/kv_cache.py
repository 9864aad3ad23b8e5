"""`allocate_kv_cache`: the paged latent cache an `MLAAttention` reads and writes, in each of its formats."""

from __future__ import annotations

import torch

from mla_multi.backends.base import resolve_kv_cache_dtype
from mla_multi.checks import check_positive_int
from mla_multi.dims import MLADims
from mla_multi.ds_mla_cache import FP8_DS_MLA_BYTES, KV_LORA_RANK, ROPE_DIM
from mla_multi.platforms import current_platform

__all__ = ["allocate_kv_cache", "kv_cache_shape"]


def kv_cache_shape(dims: MLADims, num_blocks: int, block_size: int, kv_cache_dtype: str | torch.dtype = "auto") -> tuple:
    """[num_blocks, block_size, Lkv + R] (576 for DeepSeek-V3), or [.., 656] for "fp8_ds_mla"."""
    if not isinstance(dims, MLADims):
        raise ValueError(f"dims={dims!r}; accepted: an MLADims")
    check_positive_int("num_blocks", num_blocks)
    check_positive_int("block_size", block_size)
    if kv_cache_dtype == "fp8_ds_mla":
        if (dims.kv_lora_rank, dims.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
            raise ValueError(f"kv_cache_dtype='fp8_ds_mla' holds {KV_LORA_RANK} latent and {ROPE_DIM} rotary values; "
                             f"these dims have {dims.kv_lora_rank} / {dims.qk_rope_head_dim}")
        return (num_blocks, block_size, FP8_DS_MLA_BYTES)
    return (num_blocks, block_size, dims.kv_cache_width)


def allocate_kv_cache(
    dims: MLADims,
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: str | torch.dtype = "auto",
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A zeroed paged cache for `MLAAttention` layers of `dims` (one per layer).

    Each row of a block is one token: its latent (kv_c after kv_a_layernorm, Lkv values) followed by its
    rotated k_pe (R values). Formats, by `kv_cache_dtype` (the layer's argument of that name):

    * "auto": the model `dtype` (the layer's weight dtype), [num_blocks, block_size, Lkv + R];
    * "fp8" / "fp8_e4m3": the platform's FP8 (float8_e4m3fn; float8_e4m3fnuz on gfx942), the same shape; the
      layer needs kv_cache_scale;
    * a torch dtype: that dtype, the same shape;
    * "fp8_ds_mla" (sparse MLA, DeepSeek-V3.2): uint8 [num_blocks, block_size, 656] (512 e4m3fn latent bytes,
      4 float32 tile scales, 64 bfloat16 rotary values: `mla_multi.ds_mla_cache`).

    device: None is the current CUDA device where there is one, else the CPU.
    """
    shape = kv_cache_shape(dims, num_blocks, block_size, kv_cache_dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if kv_cache_dtype == "fp8_ds_mla":
        cache_dtype = torch.uint8
    else:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype!r}; accepted: the model's floating-point torch dtype")
        cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, current_platform())
    return torch.zeros(shape, dtype=cache_dtype, device=device)
